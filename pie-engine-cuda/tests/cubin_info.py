"""Per-kernel resources an NVIDIA cubin records: registers and stack frame bytes.

The driver reads them from the ELF's ``.nv.info`` section: records of (format, attribute, size,
payload), where the per-function ones hold (symbol index, value) and the symbol names come from
``.symtab``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

EIFMT_SVAL = 0x04
EIFMT_HVAL = 0x03
EIFMT_BVAL = 0x02
EIATTR_FRAME_SIZE = 0x11
EIATTR_REGCOUNT = 0x2F


class KernelResources(NamedTuple):
    registers: int
    frame_bytes: int


def _sections(elf: bytes) -> dict[str, tuple[int, int, int]]:
    """Section name -> (file offset, size, linked section index) of an ELF64 file."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset: int) -> str:
        start = names_at + offset
        return elf[start : elf.index(b"\0", start)].decode()

    return {name(h[0]): (h[4], h[5], headers[h[6]][4] if h[6] < shnum else 0) for h in headers}


def kernel_resources(cubin: bytes) -> dict[str, KernelResources]:
    sections = _sections(cubin)
    symtab_at, symtab_size, strings_at = sections[".symtab"]
    symbols = []
    for index in range(symtab_size // 24):
        (name_offset,) = struct.unpack_from("<I", cubin, symtab_at + 24 * index)
        start = strings_at + name_offset
        symbols.append(cubin[start : cubin.index(b"\0", start)].decode())
    info_at, info_size, _ = sections[".nv.info"]
    info = cubin[info_at : info_at + info_size]
    values: dict[str, dict[int, int]] = {}
    at = 0
    while at + 2 <= len(info):
        form, attribute = info[at], info[at + 1]
        if form == EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", info, at + 2)
            if size == 8:
                symbol, value = struct.unpack_from("<II", info, at + 4)
                values.setdefault(symbols[symbol], {})[attribute] = value
            at += 4 + size
        elif form in (EIFMT_HVAL, EIFMT_BVAL):
            at += 4
        else:
            at += 2
    return {
        name: KernelResources(found.get(EIATTR_REGCOUNT, 0), found.get(EIATTR_FRAME_SIZE, 0))
        for name, found in values.items()
        if EIATTR_REGCOUNT in found
    }
