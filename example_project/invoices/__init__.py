"""Invoices charged against a ledger, with leased and fenced Celery tasks.

- :mod:`invoices.config`: where the broker, result backend, lease store and
  ledger live (an embedded default on local files, or server URLs);
- :mod:`invoices.ledger`: the ledger tables and the fenced write;
- :mod:`invoices.receipts`: a small HTTP receipt service that refuses stale
  writers;
- :mod:`invoices.tasks`: the Celery app and the ``charge_invoice`` task;
- :mod:`invoices.timeline`: what happened, recorded by every process.
"""
