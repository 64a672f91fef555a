"""A byte-level corpus from the running interpreter's own installation, as flat uint8 token files.

  gdn-corpus --out data/pycode --roots stdlib,site-packages

Every file of the chosen extensions under the roots ("stdlib": the standard library outside site-packages;
"site-packages": every installed distribution) is read in sorted order of "<root>/<relative path>". Exact
duplicates (vendored copies, the same file under two roots) are kept once, by SHA-256 of their content. A file
goes to validation by its content hash, so a file and its copies can never sit on both sides. Files are then
taken in content-hash order (a sample spread over every package, not the alphabetically first ones) until
`max_bytes` is reached, and written joined by NUL into train.bin and val.bin, which the `tokens` task reads with
token_dtype uint8 and vocab_size 256. {train,val}_files.txt list "<sha256> <name>" per file; manifest.json names
the roots, the counts and SHA-256 digests of both lists and both files, so that a results file can name the exact
corpus. Nothing in them depends on time or host, so two builds of one installation give identical bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time

ROOTS = ("stdlib", "site-packages")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}
_SEPARATOR = b"\0"  # as gdn.data.text: NUL never occurs in source text, and files holding one are skipped


def root_dirs(name: str) -> list:
  """The directories of one root name, as this interpreter lays them out."""
  paths = sysconfig.get_paths()
  if name == "stdlib":
    return [paths["stdlib"]]
  if name == "site-packages":
    return sorted({paths["purelib"], paths["platlib"]})
  raise ValueError(f"--roots names {name!r}; choose from {', '.join(ROOTS)}")


def list_files(roots, exts, max_file_bytes: int) -> list:
  """(name, path) of every file to consider, sorted by name "<root>/<relative path>"."""
  out = {}
  for root in roots:
    for top in root_dirs(root):
      if not os.path.isdir(top):
        continue
      for d, dirs, files in os.walk(top):  # symlinked directories are not followed: no cycles, no double roots
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        for f in files:
          p = os.path.join(d, f)
          if f.endswith(exts) and not os.path.islink(p) and 0 < os.path.getsize(p) <= max_file_bytes:
            out.setdefault(f"{root}/{os.path.relpath(p, top)}", p)
  return sorted(out.items())


def build(out: str, roots=ROOTS, exts=(".py",), max_bytes: int = 0, val_fraction: float = 0.02,
          max_file_bytes: int = 1 << 20) -> dict:
  """Writes out/{train.bin,val.bin,manifest.json}; returns the manifest.

  max_bytes: stop adding files once train + validation hold this many bytes (0: every file).
  max_file_bytes: larger files are left out; in site-packages they are mostly generated tables, not code.
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  if max_bytes < 0:
    raise ValueError(f"max_bytes must be >= 0 (0: no cap), got {max_bytes}")
  exts = tuple(sorted(set(exts)))
  files = list_files(roots, exts, max_file_bytes)
  seen, kept, with_nul = set(), [], 0
  for name, path in files:
    with open(path, "rb") as f:
      data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest in seen:
      continue
    seen.add(digest)
    if _SEPARATOR in data:
      with_nul += 1
      continue
    kept.append((digest, name, data))
  kept.sort()  # by content hash: a cap then keeps a sample of every package
  split = {False: [], True: []}
  total = 0
  for digest, name, data in kept:
    if max_bytes and total + len(data) + 1 > max_bytes:
      break
    split[int(digest[:8], 16) % 10_000 < val_fraction * 10_000].append((digest, name, data))
    total += len(data) + 1
  if not split[False] or not split[True]:
    raise ValueError(f"max_bytes={max_bytes} and val_fraction={val_fraction} leave an empty train or validation "
                     f"split ({len(split[False])} and {len(split[True])} files)")
  os.makedirs(out, exist_ok=True)
  manifest = dict(python=platform.python_version(), roots=list(roots), extensions=list(exts),
                  max_bytes=max_bytes, max_file_bytes=max_file_bytes, val_fraction=val_fraction,
                  files_found=len(files), duplicates_removed=len(files) - len(seen), with_nul_skipped=with_nul,
                  token_dtype="uint8", vocab_size=256)
  for is_val, key in ((False, "train"), (True, "val")):
    blob = _SEPARATOR.join(data for _, _, data in split[is_val])
    tmp = os.path.join(out, f".{key}.bin.tmp")
    with open(tmp, "wb") as f:
      f.write(blob)
    os.replace(tmp, os.path.join(out, f"{key}.bin"))
    names = "".join(f"{digest} {name}\n" for digest, name, _ in sorted(split[is_val], key=lambda x: x[1]))
    with open(os.path.join(out, f"{key}_files.txt"), "w") as f:
      f.write(names)
    manifest[key] = dict(file=f"{key}.bin", file_list=f"{key}_files.txt", files=len(split[is_val]), bytes=len(blob),
                         sha256=hashlib.sha256(blob).hexdigest(),
                         file_list_sha256=hashlib.sha256(names.encode()).hexdigest())
  with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.write("\n")
  return manifest


def describe(train_file: str):
  """What a results file should record of the corpus a token file belongs to: the manifest.json beside it, less
  its file-list names; None when there is none (a token file not built by this module)."""
  path = os.path.join(os.path.dirname(os.path.abspath(train_file)), "manifest.json")
  if not train_file or not os.path.isfile(path):
    return None
  with open(path) as f:
    m = json.load(f)
  return {k: m[k] for k in ("python", "roots", "extensions", "max_bytes", "train", "val") if k in m}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="gdn-corpus", description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="directory for train.bin, val.bin, manifest.json")
  p.add_argument("--roots", default=",".join(ROOTS), help=f"comma-separated, from {', '.join(ROOTS)}")
  p.add_argument("--ext", default=".py", help="comma-separated file name endings, e.g. .py,.pyi,.rst,.md")
  p.add_argument("--max-bytes", type=int, default=0, help="cap on train + validation bytes (0: none)")
  p.add_argument("--max-file-bytes", type=int, default=1 << 20, help="leave out larger files")
  p.add_argument("--val-fraction", type=float, default=0.02)
  a = p.parse_args(argv)
  t0 = time.perf_counter()
  try:
    m = build(a.out, tuple(r for r in a.roots.split(",") if r), tuple(e for e in a.ext.split(",") if e),
              a.max_bytes, a.val_fraction, a.max_file_bytes)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{a.out}: train {m['train']['bytes']:,} bytes in {m['train']['files']:,} files, validation "
        f"{m['val']['bytes']:,} bytes in {m['val']['files']:,} files ({m['duplicates_removed']:,} duplicates "
        f"removed of {m['files_found']:,}); {time.perf_counter() - t0:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
