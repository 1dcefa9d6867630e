"""celery-leases for Django projects.

Add ``"celery_leases.contrib.django"`` to ``INSTALLED_APPS``; it gives

- models and migrations for the lease table and the fence table
  (:mod:`.models`), the same schema the SQL store creates;
- the store URL ``django://<alias>`` for any ``DATABASES`` alias (:mod:`.store`);
- fenced ORM writes: :func:`~.fencing.fenced_update`,
  :func:`~.fencing.fenced_save` and :func:`~.fencing.advance_fence`;
- ORM writes that commit with the lease's completion, exactly once:
  :func:`~.exactly_once.exactly_once`;
- a read-only admin with a "force release" action (:mod:`.admin`);
- ``manage.py check`` checks of the lease settings and store (:mod:`.checks`).

Needs ``pip install 'celery-leases[django]'`` (Django 5.2 or newer).
"""
