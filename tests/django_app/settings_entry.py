"""The shop's settings, with ``SHOP_DATABASE_ENTRY`` (a JSON object) laid
over ``DATABASES["default"]``: the tests of the ``django://`` store run on
entries written as a project writes them (a socket folder as ``HOST``,
``OPTIONS``). Run with ``DJANGO_SETTINGS_MODULE=tests.django_app.settings_entry``.
"""

from __future__ import annotations

import json
import os

from shop import settings as shop_settings

globals().update(
    {name: getattr(shop_settings, name) for name in dir(shop_settings) if name.isupper()}
)

DATABASES = {
    **shop_settings.DATABASES,
    "default": {
        **shop_settings.DATABASES["default"],
        **json.loads(os.environ.get("SHOP_DATABASE_ENTRY", "{}")),
    },
}
