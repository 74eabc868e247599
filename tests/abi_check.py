#!/usr/bin/env python3
"""Check that libgonixl.so, include/gonixl.h and the ctypes prototypes agree.

usage: abi_check.py LIBRARY HEADER

Fails (exit 1) when:
  - a gonixl_* symbol is exported but not declared, or declared but not exported;
  - the ctypes prototypes (gonixl._lib.PROTOTYPES) are not exactly the header's
    functions in header order, or a return/argument type differs;
  - GONIXL_ABI_VERSION differs from gonixl._lib.ABI_VERSION or from the
    library's gonixl_abi_version();
  - a GONIXL_OK / GONIXL_ERR_* code differs from gonixl.errors.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys


def exported_symbols(lib: str) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True, text=True).stdout
    syms = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "T" and parts[2].startswith("gonixl_"):
            syms.append(parts[2])
    return sorted(syms)


def strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


DECL = re.compile(r"([A-Za-z_][\w\s\*]*?)\b(gonixl_\w+)\s*\(([^;{]*?)\)\s*;", re.S)


def header_functions(src: str) -> list[tuple[str, str, list[str]]]:
    body = re.sub(r"^\s*#.*$", " ", strip_comments(src), flags=re.M)  # preprocessor lines
    funcs = []
    for m in DECL.finditer(body):
        ret = " ".join(m.group(1).split())
        name = m.group(2)
        args = " ".join(m.group(3).split())
        if ret.startswith("typedef"):
            continue
        params = [] if args in ("", "void") else [a.strip() for a in args.split(",")]
        funcs.append((ret, name, params))
    return funcs


def header_defines(src: str) -> dict[str, int]:
    out = {}
    for m in re.finditer(r"#define\s+(GONIXL_\w+)\s+\(?(-?\d+)\)?", src):
        out[m.group(1)] = int(m.group(2))
    return out


def param_type(p: str) -> str:
    """Drop the parameter name: 'char *buf' -> 'char *', 'size_t len' -> 'size_t'."""
    p = " ".join(p.replace("*", " * ").split())
    toks = p.split()
    if len(toks) >= 2 and toks[-1] not in ("*",):
        toks = toks[:-1]
    return " ".join(toks).replace(" *", "*").replace("* ", "*")


def ctype_for(c: str, lib):
    handles = {"gonixl_scheduler_t", "gonixl_worker_t"}
    scalar = {
        "gonixl_status_t": ctypes.c_int32,
        "int32_t": ctypes.c_int32,
        "uint8_t": ctypes.c_uint8,
        "uint32_t": ctypes.c_uint32,
        "int64_t": ctypes.c_int64,
        "uint64_t": ctypes.c_uint64,
        "size_t": ctypes.c_size_t,
        "double": ctypes.c_double,
        "int": ctypes.c_int,
    }
    c = c.replace("const ", "")
    if c == "char*":
        return ctypes.c_char_p
    if c == "void*":
        return ctypes.c_void_p
    if c == "gonixl_error_t*":
        return ctypes.POINTER(lib.Error)
    if c == "gonixl_worker_state_t**":
        return ctypes.POINTER(ctypes.POINTER(lib.WorkerState))
    if c in handles:
        return ctypes.c_uint64
    if c.endswith("*"):
        base = c[:-1]
        if base in handles:
            return ctypes.POINTER(ctypes.c_uint64)
        if base in scalar:
            return ctypes.POINTER(scalar[base])
    if c in scalar:
        return scalar[c]
    raise ValueError(f"abi_check: no ctypes mapping for C type {c!r}; extend ctype_for")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    lib_path, header_path = sys.argv[1], sys.argv[2]
    from gonixl import _lib, errors  # the installed package under test

    problems: list[str] = []
    src = open(header_path).read()
    funcs = header_functions(src)
    names = [f[1] for f in funcs]
    syms = exported_symbols(lib_path)

    for s in sorted(set(syms) - set(names)):
        problems.append(f"exported but not declared in {header_path}: {s}")
    for n in sorted(set(names) - set(syms)):
        problems.append(f"declared in {header_path} but not exported by {lib_path}: {n}")

    proto_names = [p[0] for p in _lib.PROTOTYPES]
    if proto_names != names:
        problems.append(f"ctypes prototypes {proto_names} differ from header order {names}")
    protos = {p[0]: p for p in _lib.PROTOTYPES}
    for ret, name, params in funcs:
        if name not in protos:
            continue
        _, restype, argtypes = protos[name]
        try:
            want_ret = ctype_for(param_type(ret + " x"), _lib)
            want_args = [ctype_for(param_type(p), _lib) for p in params]
        except ValueError as e:
            problems.append(str(e))
            continue
        if restype is not want_ret:
            problems.append(f"{name}: ctypes restype {restype} != header {ret}")
        if len(argtypes) != len(want_args):
            problems.append(f"{name}: {len(argtypes)} ctypes args != {len(want_args)} in header")
        else:
            for i, (got, want) in enumerate(zip(argtypes, want_args)):
                if got is not want and getattr(got, "_type_", None) is not getattr(want, "_type_", object()):
                    problems.append(f"{name}: arg {i} ctypes {got} != header {params[i]}")

    defines = header_defines(src)
    if defines.get("GONIXL_ABI_VERSION") != _lib.ABI_VERSION:
        problems.append(f"GONIXL_ABI_VERSION {defines.get('GONIXL_ABI_VERSION')} != gonixl._lib.ABI_VERSION {_lib.ABI_VERSION}")
    if defines.get("GONIXL_ERROR_MESSAGE_SIZE") != _lib.ERROR_MESSAGE_SIZE:
        problems.append("GONIXL_ERROR_MESSAGE_SIZE differs from gonixl._lib.ERROR_MESSAGE_SIZE")
    from gonixl import engine

    for cname, value in defines.items():
        if cname in ("GONIXL_ABI_VERSION", "GONIXL_ERROR_MESSAGE_SIZE"):
            continue
        if cname.startswith(("GONIXL_FINISHED_", "GONIXL_OP_")):
            # get_finished's binary form and the scheduler batch's result
            # bits: gonixl.engine reads them.
            pyname = cname[len("GONIXL_"):]
            if getattr(engine, pyname, None) != value:
                problems.append(f"{cname}={value} but gonixl.engine.{pyname}={getattr(engine, pyname, None)}")
            continue
        pyname = cname[len("GONIXL_"):]
        if getattr(errors, pyname, None) != value:
            problems.append(f"{cname}={value} but gonixl.errors.{pyname}={getattr(errors, pyname, None)}")
        if errors.STATUS_NAMES.get(value) != cname:
            problems.append(f"gonixl.errors.STATUS_NAMES[{value}] is not {cname}")

    cdll = ctypes.CDLL(lib_path)
    cdll.gonixl_abi_version.restype = ctypes.c_uint32
    if cdll.gonixl_abi_version() != defines.get("GONIXL_ABI_VERSION"):
        problems.append("gonixl_abi_version() of the library differs from the header")

    if problems:
        for p in problems:
            print("ABI MISMATCH:", p)
        print(f"abi_check: 0 passed, {len(problems)} failed")
        return 1
    print(f"abi_check: {len(names)} functions, {len(defines)} constants agree across {lib_path}, {header_path} and gonixl._lib")
    return 0


if __name__ == "__main__":
    sys.exit(main())
