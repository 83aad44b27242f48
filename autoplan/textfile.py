"""Reading a text file the user gave (config.json, a hardware TOML, RUNS.json, metrics.jsonl,
an importer's input): UTF-8 or a UserError naming the file and what is wrong with it.

Standard library only: hardware and plan files are read on training nodes too.
"""

from __future__ import annotations

from pathlib import Path

from autoplan.errors import UserError


def read_text(path: str | Path, what: str, encoding: str = "utf-8") -> str:
    """The file's text; UserError for a missing file, a folder, or bytes that are not UTF-8
    (naming the byte offset, so a stray Latin-1 character or a binary file is found at once).
    `what` names the file's role ("config file", "hardware file", ...); `encoding` is what a
    Python file's coding line declares."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; give the file itself")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist; check the path") from None
    except OSError as exc:
        raise UserError(f"{what} {path} cannot be read ({exc.strerror}); check the path and its "
                        "permissions") from None
    return decode_text(data, what, path, encoding)


def decode_text(data: bytes, what: str, path: str | Path, encoding: str = "utf-8") -> str:
    """Bytes already read from `path` as text, or the same UserError as `read_text`."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not {encoding.upper()} text: byte 0x{data[exc.start]:02x} at offset "
                        f"{exc.start} cannot be decoded (a binary file, or text saved in another "
                        "encoding such as Latin-1); save it as UTF-8") from None
