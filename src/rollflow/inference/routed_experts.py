"""MoE routed experts on the wire: the packed JSON form engine servers put in ``choices[i].routed_experts``.

A generation's routes are integer expert ids ``[tokens, layers, topk]``, one row per token the engine ran. As
nested JSON lists they cost several bytes per id; packed they cost one or two: ``{"data": base64(raw bytes),
"shape": [tokens, layers, topk], "dtype": name}``, the bytes C-ordered and little-endian, the dtype the
smallest of uint8, int16 and int32 that holds the largest id. Readers also accept nested lists (a server that
returns routes unpacked).

numpy is imported inside the functions, so importing this module (and the inference client) stays light.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

# Wire dtypes, smallest first, with the exclusive upper bound of the ids each one packs.
ROUTED_EXPERTS_DTYPES = {"uint8": 2**8, "int16": 2**15, "int32": 2**31}


def pack_routed_experts(experts: Any) -> dict[str, Any]:
    """Pack integer routes ``[tokens, layers, topk]`` (a numpy array or anything ``np.asarray`` takes).

    Raises:
        ValueError: not a 3-D integer array, a negative id, or an id of 2**31 or more.
    """
    import numpy as np

    array = _check_routes(np.asarray(experts), "routed_experts")
    largest = int(array.max()) if array.size else 0
    name = next((name for name, bound in ROUTED_EXPERTS_DTYPES.items() if largest < bound), None)
    if name is None:
        raise ValueError(f"routed_experts holds expert id {largest}, which does not fit int32")
    data = np.ascontiguousarray(array, dtype=np.dtype(name).newbyteorder("<")).tobytes()
    return {"data": base64.b64encode(data).decode("ascii"), "shape": list(array.shape), "dtype": name}


def unpack_routed_experts(value: Any) -> Any:
    """Routes from the wire: a packed dict (see the module docstring), nested lists, or None (returned as is).

    Returns a numpy array ``[tokens, layers, topk]`` of the packed dtype (int64 from lists).

    Raises:
        ValueError: the value is malformed: an unknown dtype, bad base64, a shape that is not three
            non-negative integers, a byte count that does not match shape and dtype, a negative id, or lists
            that are ragged, not integers or not 3-D. The message says which.
    """
    import numpy as np

    if value is None:
        return None
    if isinstance(value, list):
        try:
            array = np.asarray(value)
        except ValueError:
            raise ValueError(
                "routed_experts is a ragged nested list; expected [tokens, layers, topk]"
            ) from None
        if array.size == 0 and array.ndim != 3:
            raise ValueError(f"routed_experts must be 3-D [tokens, layers, topk], got shape {array.shape}")
        return _check_routes(array.astype(np.int64) if array.size == 0 else array, "routed_experts")
    if not isinstance(value, dict):
        raise ValueError(
            f"routed_experts must be a packed object {{data, shape, dtype}}, nested lists or null, "
            f"got {type(value).__name__}"
        )
    missing = [key for key in ("data", "shape", "dtype") if key not in value]
    if missing:
        raise ValueError(f"packed routed_experts lacks {', '.join(missing)} (has {sorted(value)})")
    name, shape, data = value["dtype"], value["shape"], value["data"]
    if name not in ROUTED_EXPERTS_DTYPES:
        raise ValueError(
            f"packed routed_experts has dtype {name!r}; expected one of {', '.join(ROUTED_EXPERTS_DTYPES)}"
        )
    valid_shape = isinstance(shape, list) and len(shape) == 3
    if not valid_shape or any(type(size) is not int or size < 0 for size in shape):
        raise ValueError(
            f"packed routed_experts has shape {shape!r}; expected three non-negative integers [tokens, layers, topk]"
        )
    if not isinstance(data, str):
        raise ValueError(f"packed routed_experts data must be a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("packed routed_experts data is not valid base64") from None
    dtype = np.dtype(name).newbyteorder("<")
    expected = shape[0] * shape[1] * shape[2] * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(
            f"packed routed_experts data has {len(raw)} bytes; shape {shape} of {name} needs "
            f"{shape[0]} * {shape[1]} * {shape[2]} * {dtype.itemsize} = {expected}"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).astype(name, copy=False)
    return _check_routes(array, "packed routed_experts")


def _check_routes(array: Any, what: str) -> Any:
    import numpy as np

    if array.ndim != 3 or array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{what} must be a 3-D integer array [tokens, layers, topk], got dtype {array.dtype} and shape "
            f"{array.shape}"
        )
    if array.size and int(array.min()) < 0:
        raise ValueError(f"{what} holds a negative expert id ({int(array.min())})")
    return array
