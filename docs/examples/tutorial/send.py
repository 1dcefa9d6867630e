"""Send one charge and wait for its result: ``python send.py``."""

from shop import add_order, charge

order = add_order()
result = charge.delay(order)
print(f"order {order} charged with generation {result.get(timeout=30)}")
