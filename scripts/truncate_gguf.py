"""A GGUF model cut to its first N layers: the same tokenizer, embedding, final norm and head, as
a draft model for speculative decoding (`speculative=<path>`) where no smaller model of the
same tokenizer is at hand.

    python scripts/truncate_gguf.py MODEL.gguf OUT.gguf --layers 8

Metadata is copied as it is, but for the layer count; tensors of later layers are left out.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf

LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")


def truncate(src: Path, dst: Path, layers: int) -> int:
    """Writes `dst`; returns the layer count of `src`."""
    reader = gguf.GGUFReader(src, "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise SystemExit(f"{src}: no general.architecture")
    arch = str(arch_field.contents())
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    count_field = reader.get_field(count_key)
    if count_field is None:
        raise SystemExit(f"{src}: no {count_key}")
    total = int(count_field.contents())
    if not 1 <= layers < total:
        raise SystemExit(f"--layers must be between 1 and {total - 1}, got {layers}")
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF.* header fields itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = []
    for tensor in reader.tensors:
        m = LAYER_TENSOR.match(tensor.name)
        if m is not None and int(m.group(1)) >= layers:
            continue
        kept.append(tensor)
        writer.add_tensor_info(
            tensor.name,
            tensor.data.shape,
            tensor.data.dtype,
            tensor.data.nbytes,
            tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return total


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    args = parser.parse_args()
    total = truncate(args.model, args.out, args.layers)
    print(f"{args.out}: {args.layers} of {total} layers")
