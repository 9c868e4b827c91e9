"""The "orders" example service: a producer, outbox handlers and a webhook receiver.

* :mod:`.producer` writes an order and its events in one transaction (``orders`` + outbox).
* :mod:`.api` is a tiny HTTP API over the producer.
* :mod:`.app` is the Celery app with its :class:`~outbox_celery.app.outbox.Outbox`;
  :mod:`.handlers` deliver ``order.*`` events to a webhook over HTTP.
* :mod:`.receiver` is that webhook: it de-duplicates by ``Idempotency-Key`` with a
  transactional inbox table.
"""
