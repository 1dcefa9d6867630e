"""The DDL docs/sql.md shows for each database is the DDL the SQL store emits."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from celery_leases.stores.sql import lease_table
from celery_leases.stores.sql._indexes import indexes_in
from tests.docs.test_code_blocks import ROOT

SQL_BLOCKS = "\n".join(
    re.findall(r"```sql\n(.*?)```", (ROOT / "docs" / "sql.md").read_text(), re.DOTALL)
)


def _text(ddl: sa.schema.ExecutableDDLElement, dialect: sa.Dialect) -> str:
    """The statement as the page writes it: no space at a line's end, one
    before MySQL's table options, a semicolon."""
    lines = str(ddl.compile(dialect=dialect)).strip().splitlines()
    return "\n".join(line.rstrip() for line in lines).replace(")ENGINE=", ") ENGINE=") + ";"


def _emitted(dialect: sa.Dialect) -> list[str]:
    table = lease_table(sa.MetaData())
    return [
        _text(sa.schema.CreateTable(table), dialect),
        *(
            _text(sa.schema.CreateIndex(index), dialect)
            for index in indexes_in(table, dialect.name)
        ),
    ]


@pytest.mark.parametrize(
    "dialect", [postgresql.dialect(), mysql.dialect(), sqlite.dialect()], ids=lambda d: d.name
)
def test_the_page_shows_each_statement_the_store_emits(dialect: sa.Dialect) -> None:
    emitted = _emitted(dialect)
    if dialect.name == "sqlite":
        # the page shows PostgreSQL's table, whose text SQLite's repeats but
        # for the type of outcome (BLOB), which it names
        emitted = [emitted[0].replace("outcome BLOB", "outcome BYTEA"), *emitted[1:]]
    for statement in emitted:
        assert statement in SQL_BLOCKS, statement
