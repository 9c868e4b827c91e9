"""The outbox in Django's admin, fit for a table with millions of rows.

* No full ``COUNT(*)``: :class:`EstimatedCountPaginator` counts exactly up to a cap and above
  it takes PostgreSQL's estimate (``EXPLAIN``); ``show_full_result_count`` is off.
* Every filter reaches rows through the schema's partial indexes: the default view is the live
  messages (pending, processing, dead; done rows are history), the status filter picks one
  partial index, and the event type, ordering key, age and blocked filters narrow that set.
  Columns are not sortable (a sort on millions of rows is a full scan); the order is newest id
  first (the primary key).
* Requeue and skip call :func:`outbox_celery.ops.requeue` and :func:`outbox_celery.ops.skip`:
  the same semantics, row locks and all-or-nothing refusals as ``outbox-celery dead requeue`` and
  ``outbox-celery dead skip``.
* Nothing is editable: no add, no change form (the detail page is read-only), no delete (the
  retention task purges done rows; live rows are never deleted).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import psycopg
from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Case, Count, IntegerField, OuterRef, Q, QuerySet, Subquery, Value, When
from django.db.models.functions import Coalesce, Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.functional import cached_property
from django.utils.html import format_html

from ... import ops
from ...errors import first_line
from ...message import KEY_SEPARATOR
from .conf import outbox_database, outbox_table
from .display import attempts_table, preformatted, when
from .models import OutboxGroup, OutboxMessage, Status

__all__ = ["EstimatedCountPaginator", "OutboxMessageAdmin"]

# Exact counts up to this many rows (a bounded scan); above it, the planner's estimate.
EXACT_COUNT_LIMIT = 1000
# Actions take explicit ids; larger sets belong to `outbox-celery dead requeue --all`.
MAX_ACTION_ROWS = 1000
# The list's last-error column: the first line, this many characters (it wraps).
ERROR_EXCERPT = 100
STATUS_COLORS = {"pending": "#447e9b", "processing": "#b07d00", "done": "#3a7d44", "dead": "#ba2121"}
SKIPPED_COLOR = "#767676"
# A message's detail page: its sections and their fields.
MESSAGE_FIELDSETS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    (None, ("id", "event_type", "status", "state", "aggregate_type", "aggregate_id")),
    ("Payload", ("payload_json",)),
    ("Delivery", ("attempts", "last_error_text", "failed_attempts", "available_at", "created_at", "done_at")),
    ("Lease", ("lease_owner", "lease_until", "lease_version", "started_version")),
    ("Ordering", ("ordering_key", "head", "key_position")),
    ("Producer", ("dedup_key", "trace_context")),
)


def _psycopg(using: str) -> psycopg.Connection[Any]:
    wrapper = connections[using]
    wrapper.ensure_connection()
    conn: psycopg.Connection[Any] = wrapper.connection
    return conn


# -- which rows: every condition below matches the predicate of a partial index ---------------


def status_q(status: str) -> Q:
    """Rows of one status, written so PostgreSQL can use the partial indexes.

    Pending rows live in two indexes (unordered: ``pending_idx``; ordered: ``ordered_idx``), so
    the condition names both arms; a bare ``status = 'pending'`` would scan the table.
    """
    if status == Status.PENDING:
        return Q(status=status, ordering_key__isnull=True) | Q(status=status, ordering_key__isnull=False)
    return Q(status=status)


def live_q() -> Q:
    """Rows not done (pending, processing, dead): a bitmap OR of the partial indexes."""
    return status_q(Status.PENDING) | Q(status=Status.PROCESSING) | Q(status=Status.DEAD)


def blocked_heads_q() -> Q:
    """Dead messages at the head of their ordering key: each one holds its key (invariant 9).

    The head is the flagged message (the claim reads the flag), as in ``outbox-celery stats``.
    """
    return Q(status=Status.DEAD, head=True, ordering_key__isnull=False)


class StatusFilter(admin.SimpleListFilter):
    """Live messages by default; one status, or everything including done."""

    title = "status"
    parameter_name = "status"
    ALL = "all"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            (Status.PENDING, "pending"),
            (Status.PROCESSING, "processing"),
            (Status.DEAD, "dead"),
            (Status.DONE, "done"),
            (self.ALL, "all, including done"),
        ]

    def choices(self, changelist: Any) -> Any:
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": "live (not done)",
        }
        for lookup, title in self.lookup_choices:
            yield {
                "selected": self.value() == str(lookup),
                "query_string": changelist.get_query_string({self.parameter_name: lookup}),
                "display": title,
            }

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset.filter(live_q())
        if value == self.ALL:
            return queryset
        if value in Status.values:
            return queryset.filter(status_q(value))
        return queryset.none()


class EventTypeFilter(admin.SimpleListFilter):
    """Event types of the live messages (listed from the partial indexes, never the history)."""

    title = "event type"
    parameter_name = "event_type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        types = (
            model_admin.get_queryset(request)
            .filter(live_q())
            .order_by()
            .values_list("event_type", flat=True)
            .distinct()
        )
        found = sorted(set(types[:100]))
        value = self.value()
        if value and value not in found:  # a done-only type reached by URL stays selectable
            found.append(value)
        return [(t, t) for t in found]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(event_type=self.value()) if self.value() else queryset


class OrderingKeyFilter(admin.SimpleListFilter):
    """Blocked ordering keys (dead head) are listed; any key can be reached from a row's link."""

    title = "ordering key (blocked keys listed)"
    parameter_name = "ordering_key"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        keys = list(
            model_admin.get_queryset(request)
            .filter(blocked_heads_q())
            .order_by("id")
            .values_list("ordering_key", flat=True)[:20]
        )
        choices = [(k, f"{k} (blocked)") for k in keys]
        value = self.value()
        if value and value not in keys:  # a key reached from a row's link stays selectable
            choices.append((value, value))
        return choices

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The key's rows; a producer's key also finds its subscriptions' rows, whose stored key
        is ``<key>`` chr(31) route (DESIGN invariant 28); a stored key with its route, that
        subscription's alone."""
        value = self.value()
        if not value:
            return queryset
        if KEY_SEPARATOR in value:
            return queryset.filter(ordering_key=value)
        return queryset.filter(Q(ordering_key=value) | Q(ordering_key__startswith=value + KEY_SEPARATOR))


class BlockedFilter(admin.SimpleListFilter):
    """Dead heads that block their ordering key."""

    title = "ordered delivery"
    parameter_name = "blocked"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("heads", "dead heads blocking their key")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(blocked_heads_q()) if self.value() == "heads" else queryset


class AgeFilter(admin.SimpleListFilter):
    """Age since ``created_at``, measured with the database clock (``now()``)."""

    title = "age"
    parameter_name = "age"
    AGES = {
        "lt1h": ("newer than 1 hour", timedelta(hours=1), False),
        "gt5m": ("older than 5 minutes", timedelta(minutes=5), True),
        "gt1h": ("older than 1 hour", timedelta(hours=1), True),
        "gt1d": ("older than 1 day", timedelta(days=1), True),
        "gt7d": ("older than 7 days", timedelta(days=7), True),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(k, label) for k, (label, _age, _older) in self.AGES.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        choice = self.AGES.get(self.value() or "")
        if choice is None:
            return queryset
        _, age, older = choice
        if older:
            return queryset.filter(created_at__lte=Now() - age)
        return queryset.filter(created_at__gt=Now() - age)


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[OutboxMessage]
    _GroupAdmin = admin.ModelAdmin[OutboxGroup]
    _Paginator = Paginator[Any]
else:  # Django's classes are not subscriptable at run time (django-stubs makes them generic)
    _ModelAdmin = admin.ModelAdmin
    _GroupAdmin = admin.ModelAdmin
    _Paginator = Paginator


# -- counting -----------------------------------------------------------------------------------


class EstimatedCountPaginator(_Paginator):
    """Exact up to :data:`EXACT_COUNT_LIMIT` rows, PostgreSQL's estimate above (never a full count)."""

    @cached_property
    def count(self) -> int:
        qs: QuerySet[Any] = self.object_list  # type: ignore[assignment]
        exact = int(qs[: EXACT_COUNT_LIMIT + 1].count())
        if exact <= EXACT_COUNT_LIMIT:
            return exact
        return max(exact, self._estimate(qs))

    @staticmethod
    def _estimate(qs: QuerySet[Any]) -> int:
        compiler = qs.order_by().query.get_compiler(using=qs.db)
        text, params = compiler.as_sql()
        with connections[qs.db].cursor() as cur:
            # The statement is the ORM's own, with its parameters bound: nothing external is spliced.
            cur.execute("EXPLAIN (FORMAT JSON) " + text, params)
            row = cur.fetchone()
            columns = [c.name for c in cur.description]
        plan = dict(zip(columns, row, strict=True))["QUERY PLAN"]
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])


class OutboxChangeList(ChangeList):
    """Skips the unfiltered count Django would otherwise run for "N total"."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        self.full_result_count = None


class SkipForm(forms.Form):
    """The reason a skip requires (recorded in ``last_error``)."""

    reason = forms.CharField(max_length=ops.MAX_REASON_LENGTH, strip=True)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(_ModelAdmin):
    """List, filter and explain outbox messages; requeue or skip dead ones."""

    # Sized to fit a 1,400 px window beside the filters: what a dead head blocks sits under
    # its status, the ordering key under the aggregate, times on two short lines, the error wraps.
    list_display = (
        "id",
        "event_type",
        "status_badge",
        "attempts",
        "aggregate_and_key",
        "created",
        "available",
        "error_excerpt",
    )
    list_display_links = ("id", "event_type")
    list_filter = (StatusFilter, EventTypeFilter, OrderingKeyFilter, BlockedFilter, AgeFilter)
    list_per_page = 50
    list_max_show_all = 200
    sortable_by = ()
    ordering = ("-id",)
    show_full_result_count = False
    # Django 5's per-choice facet counts would count the whole table once per filter choice.
    if hasattr(admin, "ShowFacets"):
        show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    actions = [
        "requeue_dead",
        "skip_messages",
        "pause_event_types",
        "resume_event_types",
        "pause_limit_keys",
        "resume_limit_keys",
    ]
    change_list_template = "admin/outbox_celery/outboxmessage/change_list.html"
    fieldsets = tuple((title, {"fields": fields}) for title, fields in MESSAGE_FIELDSETS)
    # Every field the detail page shows, read-only: it has no form.
    readonly_fields = tuple(field for _title, fields in MESSAGE_FIELDSETS for field in fields)

    # -- where and how ---------------------------------------------------------------------------

    @property
    def using(self) -> str:
        """The alias holding the table (``OUTBOX_DATABASE``)."""
        return outbox_database()

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxMessage]:
        waiting = (
            OutboxMessage.objects.using(self.using)
            .filter(ordering_key=OuterRef("ordering_key"), id__gt=OuterRef("id"), ordering_key__isnull=False)
            .exclude(status=Status.DONE)
            .order_by()
            .values("ordering_key")
            .annotate(n=Count("*"))
            .values("n")
        )
        return (
            super()
            .get_queryset(request)
            .using(self.using)
            .annotate(
                # Only dead ordered rows can block a key: the subquery runs for those alone.
                waiting_behind=Case(
                    When(
                        status=Status.DEAD,
                        ordering_key__isnull=False,
                        then=Coalesce(Subquery(waiting, output_field=IntegerField()), Value(0)),
                    ),
                    default=Value(0),
                    output_field=IntegerField(),
                )
            )
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return OutboxChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The list's actions need "change"; a message's page is read-only (no form, no save).
        return obj is None and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        context = dict(extra_context or {})
        try:
            context["outbox_stats"] = ops.stats(_psycopg(self.using), outbox_table(), timeout=2.0)
        except psycopg.Error as exc:  # a slow or failing summary must not hide the list
            context["outbox_stats_error"] = first_line(exc)
        context["outbox_table"] = str(outbox_table())
        return super().changelist_view(request, extra_context=context)

    # -- columns ---------------------------------------------------------------------------------

    @admin.display(description="status")
    def status_badge(self, obj: OutboxMessage) -> str:
        if ops.was_skipped(obj.status, obj.last_error):
            # Still "done" in the table (its state machine is unchanged); shown for what it is.
            return format_html(
                '<b style="color:{}" title="done without delivery: skipped by an operator">skipped</b>',
                SKIPPED_COLOR,
            )
        color = STATUS_COLORS.get(obj.status, "inherit")
        badge = format_html('<b style="color:{}">{}</b>', color, obj.status)
        n = int(getattr(obj, "waiting_behind", 0) or 0)
        if obj.status == Status.DEAD and obj.ordering_key is not None and n:
            return format_html(
                '{}<br><small style="color:#ba2121;white-space:nowrap" title="messages of its ordering '
                'key waiting behind it">blocks {} waiting</small>',
                badge,
                n,
            )
        return badge

    @admin.display(description="aggregate / ordering key")
    def aggregate_and_key(self, obj: OutboxMessage) -> str:
        aggregate = f"{obj.aggregate_type}:{obj.aggregate_id}"
        if obj.ordering_key is None:
            return aggregate
        query = urlencode({"ordering_key": obj.ordering_key, "status": StatusFilter.ALL})
        link = format_html('<a href="?{}">{}</a>', query, obj.ordering_key)
        if obj.ordering_key == aggregate:  # ordered by its aggregate, the usual case
            return link
        return format_html("{}<br><small>key {}</small>", aggregate, link)

    @admin.display(description="created")
    def created(self, obj: OutboxMessage) -> str:
        return when(obj.created_at)

    @admin.display(description="available at")
    def available(self, obj: OutboxMessage) -> str:
        return when(obj.available_at)

    @admin.display(description="last error")
    def error_excerpt(self, obj: OutboxMessage) -> str:
        text = (obj.last_error or "").splitlines()[0] if obj.last_error else ""
        short = text[:ERROR_EXCERPT] + ("…" if len(text) > ERROR_EXCERPT else "")
        style = "display:block;min-width:14em;overflow-wrap:anywhere"
        return format_html('<span style="{}">{}</span>', style, short)

    # -- detail ----------------------------------------------------------------------------------

    @admin.display(description="payload")
    def payload_json(self, obj: OutboxMessage) -> str:
        text = json.dumps(obj.stored_payload(), indent=2, ensure_ascii=False, sort_keys=True)
        return preformatted(text)

    @admin.display(description="last error")
    def last_error_text(self, obj: OutboxMessage) -> str:
        if not obj.last_error:
            return "-"
        return preformatted(obj.last_error)

    @admin.display(description="failed attempts")
    def failed_attempts(self, obj: OutboxMessage) -> str:
        return attempts_table(obj.errors)

    def _explained(self, obj: OutboxMessage) -> dict[str, Any]:
        # Kept on the instance, which lives for one request (the ModelAdmin is shared).
        explained: dict[str, Any] | None = getattr(obj, "_outbox_explained", None)
        if explained is None:
            explained = ops.get_message(_psycopg(self.using), outbox_table(), obj.pk) or {}
            obj._outbox_explained = explained  # type: ignore[attr-defined]
        return explained

    @admin.display(description="state")
    def state(self, obj: OutboxMessage) -> str:
        row = self._explained(obj)
        fmt = ops.format_duration
        if obj.status == Status.PENDING:
            wait = row.get("available_in") or 0
            if obj.ordering_key is not None and row.get("key_head") is None:
                return "not claimed: no message of its ordering key is its head (outbox-celery repair-heads)"
            if obj.ordering_key is not None and row.get("key_head") != obj.pk:
                return f"waits behind message #{row['key_head']} of its ordering key"
            return f"claimable in {fmt(wait)}" if wait > 0 else "claimable now"
        if obj.status == Status.PROCESSING:
            left = row.get("lease_expires_in")
            if left is not None and left <= 0:
                return f"lease expired {fmt(-left)} ago: the next claim takes it back (or reaps it)"
            return f"leased to {obj.lease_owner or '?'} for {fmt(left)} more"
        if obj.status == Status.DEAD:
            behind = int(row.get("waiting_behind") or 0)
            blocking = (
                f"; blocks {behind} message(s) of its ordering key" if obj.ordering_key and behind else ""
            )
            return f"dead after {obj.attempts} attempt(s): requeue or skip it{blocking}"
        if ops.was_skipped(obj.status, obj.last_error):
            return "skipped by an operator: done without delivery (the reason is in the last error)"
        return "done: delivered"

    @admin.display(description="position in its key")
    def key_position(self, obj: OutboxMessage) -> str:
        if obj.ordering_key is None:
            return "not ordered"
        row = self._explained(obj)
        head = row.get("key_head")
        behind = int(row.get("waiting_behind") or 0)
        if head is None:
            where = "done" if obj.status == Status.DONE else "no head in its key (outbox-celery repair-heads)"
        else:
            where = "head of its key" if head == obj.pk else f"behind #{head}"
        return f"{where}; {behind} unfinished message(s) after it"

    # -- actions ---------------------------------------------------------------------------------

    def _ids(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> list[int] | None:
        ids = list(queryset.order_by().values_list("id", flat=True)[: MAX_ACTION_ROWS + 1])
        if len(ids) > MAX_ACTION_ROWS:
            self.message_user(
                request,
                f"at most {MAX_ACTION_ROWS} messages per action; for more use "
                "`outbox-celery dead requeue --all` (batched)",
                messages.ERROR,
            )
            return None
        return ids

    @admin.action(description="Requeue selected dead messages", permissions=["change"])
    def requeue_dead(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """Dead -> pending now, attempts reset; refuses the whole selection if one is not dead."""
        ids = self._ids(request, queryset)
        if ids is None:
            return
        try:
            done = ops.requeue(_psycopg(self.using), outbox_table(), ids, reason=_who(request))
        except ops.AdminError as exc:
            self.message_user(request, f"nothing requeued: {exc}", messages.ERROR)
            return
        self.message_user(request, f"requeued {len(done)} message(s): {_id_list(done)}", messages.SUCCESS)

    @admin.action(description="Skip selected messages (mark done without delivery)…", permissions=["change"])
    def skip_messages(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> HttpResponse | None:
        """Dead or pending -> done with a reason, after a confirmation page that asks for it."""
        ids = self._ids(request, queryset)
        if ids is None:
            return None
        form = SkipForm(request.POST if "confirm" in request.POST else None)
        if "confirm" in request.POST and form.is_valid():
            reason = f"{form.cleaned_data['reason']} ({_who(request)})"
            try:
                done = ops.skip(_psycopg(self.using), outbox_table(), ids, reason=reason)
            except ops.AdminError as exc:
                self.message_user(request, f"nothing skipped: {exc}", messages.ERROR)
                return None
            self.message_user(request, f"skipped {len(done)} message(s): {_id_list(done)}", messages.SUCCESS)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Skip messages without delivering them",
            "opts": self.model._meta,
            "messages_to_skip": queryset.order_by("id")[:MAX_ACTION_ROWS],
            "ids": ids,
            "form": form,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/outbox_celery/outboxmessage/skip_confirmation.html", context)

    def _targets(self, queryset: QuerySet[OutboxMessage], *, keys: bool) -> list[tuple[str, str | None]]:
        # The distinct event types (or (event type, limit key) pairs) of the selection, at most
        # the action's row cap of them; messages without a limit key have no key to act on.
        qs = queryset.order_by()
        if keys:
            pairs = qs.filter(limit_key__isnull=False).values_list("event_type", "limit_key").distinct()
            return sorted((str(t), str(k)) for t, k in pairs[:MAX_ACTION_ROWS])
        types = qs.values_list("event_type", flat=True).distinct()[:MAX_ACTION_ROWS]
        return sorted((str(t), None) for t in types)

    def _flow_action(
        self, request: HttpRequest, queryset: QuerySet[OutboxMessage], verb: str, *, keys: bool = False
    ) -> None:
        conn = _psycopg(self.using)
        change = ops.pause if verb == "pause" else ops.resume
        changed: list[str] = []
        unchanged: list[str] = []
        targets = self._targets(queryset, keys=keys)
        if not targets:
            self.message_user(request, "none of the selected messages has a limit key", messages.WARNING)
            return
        try:
            for event_type, key in targets:
                name = event_type if key is None else f"{event_type} key {key}"
                done = change(conn, outbox_table(), event_type, limit_key=key)
                (changed if done else unchanged).append(name)
        except (ops.AdminError, psycopg.Error) as exc:
            done_first = f" ({', '.join(changed)} done first)" if changed else ""
            self.message_user(request, f"could not {verb}: {first_line(exc)}{done_first}", messages.ERROR)
            return
        past = "paused" if verb == "pause" else "resumed"
        if changed:
            self.message_user(request, f"{past} {', '.join(changed)}", messages.SUCCESS)
        if unchanged:
            state = "already paused" if verb == "pause" else "neither paused nor held"
            self.message_user(request, f"{state}: {', '.join(unchanged)}", messages.WARNING)

    @admin.action(description="Pause the event types of the selected messages", permissions=["change"])
    def pause_event_types(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """No claim hands out messages of these event types, on any worker, until resumed
        (``outbox-celery pause``; deliveries already running finish)."""
        self._flow_action(request, queryset, "pause")

    @admin.action(description="Resume the event types of the selected messages", permissions=["change"])
    def resume_event_types(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """End a pause or a ``RateLimited`` hold of these event types; the push listeners are
        woken, so their messages are claimed at once (``outbox-celery resume``)."""
        self._flow_action(request, queryset, "resume")

    @admin.action(description="Pause the limit keys of the selected messages", permissions=["change"])
    def pause_limit_keys(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """Only these limit keys of their event types wait; the types' other keys flow on
        (``outbox-celery pause EVENT_TYPE --key KEY``, DESIGN invariant 24)."""
        self._flow_action(request, queryset, "pause", keys=True)

    @admin.action(description="Resume the limit keys of the selected messages", permissions=["change"])
    def resume_limit_keys(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """End a pause or a ``RateLimited`` hold of these limit keys
        (``outbox-celery resume EVENT_TYPE --key KEY``)."""
        self._flow_action(request, queryset, "resume", keys=True)


def _who(request: HttpRequest) -> str:
    """Who acts, as a requeue's or skip's reason records it."""
    user = getattr(request, "user", None)
    return f"Django admin user {user.get_username()}" if user is not None else "Django admin"


def _id_list(ids: list[int]) -> str:
    shown = ", ".join(f"#{i}" for i in ids[:20])
    return shown + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")


@admin.register(OutboxGroup)
class OutboxGroupAdmin(_GroupAdmin):
    """Groups with a callback (DESIGN invariant 29): progress, state; finish or cancel by hand."""

    list_display = ("id", "state", "progress", "dead", "event_type", "created_at", "callback_id")
    list_filter = ("state",)
    list_per_page = 50
    ordering = ("-id",)
    sortable_by = ()
    show_full_result_count = False
    actions = ["finish_groups", "cancel_groups"]
    readonly_fields = (
        "id", "state", "total", "done", "dead", "skip_on_dead", "event_type", "dead_members",
        "callback_id", "created_at", "closed_at", "note",
    )  # fmt: skip

    @property
    def using(self) -> str:
        """The alias holding the table (``OUTBOX_DATABASE``)."""
        return outbox_database()

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxGroup]:
        return super().get_queryset(request).using(self.using)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="progress")
    def progress(self, obj: OutboxGroup) -> str:
        """Members with a final outcome, of all."""
        return f"{obj.done + obj.dead} of {obj.total}"

    def _close(self, request: HttpRequest, queryset: QuerySet[OutboxGroup], finish: bool) -> None:
        who = _who(request)
        conn = _psycopg(self.using)
        closed, refused = [], []
        for g in sorted(queryset.values_list("id", flat=True)):
            try:
                if finish:
                    ops.finish_group(conn, outbox_table(), g, reason=f"finished by {who}")
                else:
                    ops.cancel_group(conn, outbox_table(), g, reason=f"cancelled by {who}")
                closed.append(g)
            except ops.AdminError:
                refused.append(g)
        verb = "finished" if finish else "cancelled"
        self.message_user(request, f"{verb} {len(closed)} group(s): {_id_list(closed)}", messages.SUCCESS)
        if refused:
            self.message_user(request, f"not open, left as they are: {_id_list(refused)}", messages.WARNING)

    @admin.action(
        description="Finish selected open groups now (enqueue their callbacks)", permissions=["change"]
    )
    def finish_groups(self, request: HttpRequest, queryset: QuerySet[OutboxGroup]) -> None:
        """Close each open group and enqueue its callback with the outcomes so far."""
        self._close(request, queryset, finish=True)

    @admin.action(description="Cancel selected open groups (no callback, ever)", permissions=["change"])
    def cancel_groups(self, request: HttpRequest, queryset: QuerySet[OutboxGroup]) -> None:
        """Close each open group for good: its callback is never enqueued."""
        self._close(request, queryset, finish=False)
