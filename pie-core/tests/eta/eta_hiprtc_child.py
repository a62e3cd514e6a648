"""Compile HIP source from stdin with hiprtc; the code object goes to stdout.

Run in its own process: hiprtc loads ROCm's LLVM, which aborts when another LLVM (PoCL's)
is loaded in the same process. Usage: python eta_hiprtc_child.py gfx90a < source.hip
"""

import sys

from hip import hiprtc


def main(arch: str) -> int:
    source = sys.stdin.buffer.read()
    err, prog = hiprtc.hiprtcCreateProgram(source, b"eta.hip", 0, [], [])
    if err != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
        print(f"hiprtcCreateProgram: {err}", file=sys.stderr)
        return 1
    try:
        options = [f"--offload-arch={arch}".encode()]
        (err,) = hiprtc.hiprtcCompileProgram(prog, len(options), options)
        if err != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
            _, size = hiprtc.hiprtcGetProgramLogSize(prog)
            log = bytearray(size)
            if size:
                hiprtc.hiprtcGetProgramLog(prog, log)
            print(f"hiprtc failed for {arch}: {err}\n{bytes(log).decode(errors='replace')}", file=sys.stderr)
            return 1
        _, size = hiprtc.hiprtcGetCodeSize(prog)
        code = bytearray(size)
        hiprtc.hiprtcGetCode(prog, code)
        sys.stdout.buffer.write(bytes(code))
        return 0
    finally:
        hiprtc.hiprtcDestroyProgram(prog.createRef())  # takes a hiprtcProgram*


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
