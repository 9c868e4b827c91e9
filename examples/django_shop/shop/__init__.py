"""The shop project. Loading the Celery app here makes ``shop.celery.app`` the current app."""

from .celery import app as celery_app

__all__ = ["celery_app"]
