"""The tutorial's tests keep their files in a temporary folder, never in the shop's own."""

from __future__ import annotations

import os
import shutil
import tempfile

# set before test_shop.py imports shop, which opens its files when imported
DATA = tempfile.mkdtemp(prefix="shop-tests-")
os.environ["SHOP_DATA"] = DATA


def pytest_unconfigure() -> None:
    shutil.rmtree(DATA, ignore_errors=True)
