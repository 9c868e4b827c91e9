"""Integrations with frameworks: :mod:`outbox_celery.contrib.django`."""
