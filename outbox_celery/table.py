"""The outbox table's name: one schema-qualified name, always quoted as identifiers."""

from __future__ import annotations

import re
from dataclasses import dataclass

from psycopg import sql

from .errors import ConfigurationError

__all__ = ["TableName"]

# Leaves room under PostgreSQL's 63-byte identifier limit for the index-name suffixes. The
# limit is in bytes (PostgreSQL silently truncates longer identifiers), so it is checked on
# the UTF-8 encoding, not on the number of characters.
_MAX_TABLE_NAME = 40
_PART = re.compile(r"[^\x00\"]{1," + str(_MAX_TABLE_NAME) + r"}")


def _valid_part(part: str) -> bool:
    return _PART.fullmatch(part) is not None and len(part.encode("utf-8")) <= _MAX_TABLE_NAME


@dataclass(frozen=True, slots=True)
class TableName:
    """A validated, optionally schema-qualified table name.

    ``"outbox"`` or ``"events.outbox"``. Both parts are always quoted as identifiers, never
    spliced into SQL text. A dot separates schema from name, so names themselves cannot contain
    one.
    """

    name: str
    schema: str | None = None

    @classmethod
    def parse(cls, value: str | TableName) -> TableName:
        """Parse ``"name"`` or ``"schema.name"``; raise :class:`ConfigurationError` if invalid."""
        if isinstance(value, TableName):
            return value
        if not isinstance(value, str):
            raise ConfigurationError(f"table must be a string, got {type(value).__name__}")
        parts = value.split(".")
        if len(parts) > 2 or not all(_valid_part(p) for p in parts):
            raise ConfigurationError(
                f"invalid table name {value!r}: use 'name' or 'schema.name', each 1-"
                f"{_MAX_TABLE_NAME} bytes in UTF-8, no quotes or NUL"
            )
        if len(parts) == 2:
            return cls(name=parts[1], schema=parts[0])
        return cls(name=parts[0])

    @property
    def qualified(self) -> str:
        """The name as the user wrote it (used in logs and task ids)."""
        return f"{self.schema}.{self.name}" if self.schema else self.name

    def identifier(self, suffix: str = "") -> sql.Identifier:
        """The table (or a sibling object named ``<name><suffix>``) as a quoted identifier."""
        if self.schema:
            return sql.Identifier(self.schema, self.name + suffix)
        return sql.Identifier(self.name + suffix)

    def index_name(self, suffix: str) -> sql.Identifier:
        """An index name (never schema-qualified in CREATE INDEX)."""
        return sql.Identifier(self.name + suffix)

    def __str__(self) -> str:
        return self.qualified
