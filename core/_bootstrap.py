"""The first code a callable rank runs in its fresh interpreter (see process.python_call_argv)."""

from __future__ import annotations

import os
import pickle
import runpy
import sys


def _load_main(path: str) -> None:
    # What multiprocessing's spawn does: the caller's script becomes __mp_main__ and stands in for
    # __main__ so that pickled references like __main__.train resolve.
    module = type(sys)("__mp_main__")
    sys.modules["__mp_main__"] = module
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = module


def main() -> None:
    payload_path, result_path = sys.argv[1], sys.argv[2]
    with open(payload_path, "rb") as f:
        prep = pickle.load(f)
        sys.path[:] = prep["sys_path"]
        os.chdir(prep["cwd"])
        if prep["main_path"]:
            _load_main(prep["main_path"])
        fn, args = pickle.load(f)

    from ranktop.core.errors import record

    result = record(fn)(*args)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    main()
