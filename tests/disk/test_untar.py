"""`controller.node.untar` on real files: hostile tar streams never write outside DEST, never follow a link, never
overwrite, and fail with one UntarError (never another exception); GNU tar's own streams round-trip."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import stat
import subprocess
import tarfile
import tempfile
import tracemalloc
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.node import untar


# --- helpers -----------------------------------------------------------------------------------------------
def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "", mode: int = 0o644) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.size, info.mtime = kind, link, mode, len(data), 1_700_000_000
    return info, data


def stream(*members: tuple, format: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=format) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def header(name: bytes, kind: bytes, size: int | bytes, magic: bytes = b"ustar\x0000") -> bytes:
    """One hand-made 512-byte header with a correct checksum (`size` as bytes is the field as it is)."""
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\0"
    block[124:136] = size if isinstance(size, bytes) else b"%011o\0" % size
    block[136:148] = b"%011o\0" % 1_700_000_000
    block[156:157] = kind
    block[257:265] = magic
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def pax(**records: bytes) -> bytes:
    """A pax header's data: `LENGTH KEY=VALUE\\n` records, LENGTH counting itself."""
    out = b""
    for key, value in records.items():
        body = b" %s=%s\n" % (key.encode(), value)
        length = len(body) + len(str(len(body)))
        length += len(str(length)) - len(str(len(body)))
        out += b"%d%s" % (length, body)
    return out


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


END = bytes(1024)


def unpack(dest: Path, data: bytes, *, merge: bool = False) -> tuple[untar.Extracted, list[tuple[str, str]]]:
    warnings: list[tuple[str, str]] = []
    fd = untar.open_dest(dest, merge=merge)
    try:
        done = untar.extract(io.BytesIO(data), fd, lambda name, why: warnings.append((name, why)))
    finally:
        os.close(fd)
    return done, warnings


def snapshot(top: Path, skip: Path) -> dict[str, tuple[int, bytes | str | None]]:
    """Every entry under `top` except those under `skip`: its type and content (a link's target)."""
    seen: dict[str, tuple[int, bytes | str | None]] = {}
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            path = Path(root) / name
            if path == skip or skip in path.parents:
                continue
            mode = path.lstat().st_mode
            body = os.readlink(path) if stat.S_ISLNK(mode) else path.read_bytes() if stat.S_ISREG(mode) else None
            seen[str(path.relative_to(top))] = (stat.S_IFMT(mode), body)
    return seen


class Sandbox:
    """tmp/outside (with a canary) beside tmp/dest; `untouched()` is True when nothing but DEST changed."""

    def __init__(self, top: Path) -> None:
        self.top, self.dest, self.outside = top, top / "dest", top / "outside"
        self.outside.mkdir()
        (self.outside / "canary").write_text("canary")
        self.before = snapshot(top, self.dest)

    def untouched(self) -> bool:
        return snapshot(self.top, self.dest) == self.before

    def inside(self) -> dict[str, tuple[int, bytes | str | None]]:
        return snapshot(self.dest, self.dest / "\0") if self.dest.is_dir() else {}


@pytest.fixture
def box(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def no_link_made_below(dest: Path, planted: set[Path] = frozenset()) -> bool:  # type: ignore[assignment]
    for root, dirs, files in os.walk(dest):
        for name in dirs + files:
            path = Path(root) / name
            st_ = path.lstat()
            if path not in planted and (stat.S_ISLNK(st_.st_mode) or (stat.S_ISREG(st_.st_mode) and st_.st_nlink > 1)):
                return False
    return True


# --- GNU tar's own streams ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar", "oldgnu"])
def test_gnu_tar_streams_of_a_normal_tree_round_trip_byte_for_byte(tmp_path, fmt):
    src = tmp_path / "src"
    deep = src / ("d" * 120) / ("e" * 120) / "logs" if fmt != "ustar" else src / "d" / "logs"
    deep.mkdir(parents=True)
    (deep / "build.log").write_bytes(b"ok\n")
    (src / "big.bin").write_bytes(os.urandom(300_000))
    (src / "empty").write_bytes(b"")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "ünïcode name").write_text("x")
    (src / "private").mkdir(mode=0o700)
    os.utime(src / "big.bin", (1_600_000_000, 1_600_000_000))
    os.utime(src / "private", (1_500_000_000, 1_500_000_000))
    tar = subprocess.run(["tar", f"--format={fmt}", "-cf", "-", "-C", str(src), "."], capture_output=True, check=True)
    done, warnings = unpack(tmp_path / "dest", tar.stdout)
    assert warnings == [] and done.refused == 0
    assert snapshot(tmp_path / "dest", tmp_path / "none") == snapshot(src, tmp_path / "none")
    copied = tmp_path / "dest"
    assert (copied / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (copied / "empty").stat().st_mode & 0o777 == 0o644
    assert (copied / "private").stat().st_mode & 0o777 == 0o700
    assert (copied / "big.bin").stat().st_mtime == 1_600_000_000
    assert (copied / "private").stat().st_mtime == 1_500_000_000


def test_a_file_from_before_1970_is_copied_with_the_copys_own_time(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "old").write_text("x")
    os.utime(src / "old", (-100_000, -100_000))
    tar = subprocess.run(["tar", "--format=gnu", "-cf", "-", "-C", str(src), "old"], capture_output=True, check=True)
    done, warnings = unpack(tmp_path / "dest", tar.stdout)
    assert warnings == [] and done.written == 1
    assert (tmp_path / "dest" / "old").read_text() == "x" and (tmp_path / "dest" / "old").stat().st_mtime > 0


def test_the_end_of_archive_padding_is_read_so_tar_never_dies_of_a_closed_pipe(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    with subprocess.Popen(["tar", "-cf", "-", "-C", str(src), "f"], stdout=subprocess.PIPE) as tar:
        assert tar.stdout is not None
        fd = untar.open_dest(tmp_path / "dest", merge=False)
        untar.extract(tar.stdout, fd, lambda *_: None)
        os.close(fd)
        assert tar.stdout.read() == b""
    assert tar.returncode == 0


# --- members that would land outside, or are not files or directories ---------------------------------------
@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../escape", "a '..' component"),
        ("a/../../escape", "a '..' component"),
        ("/abs", "an absolute path"),
        ("//abs", "an absolute path"),
        ("", "an empty name"),
        ("x" * 256, "a name component over 255 bytes"),
        ("a/" * 2100 + "f", "a name of 4201 bytes (the limit is 4096)"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "double-slash", "empty", "long-component", "long-name"],
)
def test_names_that_leave_dest_or_cannot_be_made_are_refused(box, name, why):
    done, warnings = unpack(box.dest, stream(member(name, data=b"pwned"), member("fine", data=b"ok")))
    assert warnings == [(name, why)]
    assert (done.written, done.refused) == (1, 1)
    assert box.inside() == {"fine": (stat.S_IFREG, b"ok")}
    assert box.untouched()


def test_a_nul_in_a_pax_path_is_refused(box):
    record = pax(path=b"a\0b")
    data = header(b"PaxHeader", b"x", len(record)) + padded(record) + header(b"a", b"0", 1) + padded(b"x") + END
    done, warnings = unpack(box.dest, data)
    assert warnings == [("a\x00b", "a NUL byte in its name")] and done.refused == 1
    assert box.inside() == {} and box.untouched()


@pytest.mark.parametrize(
    ("kind", "link", "why"),
    [
        (tarfile.SYMTYPE, "/etc", "a symbolic link (to '/etc')"),
        (tarfile.SYMTYPE, "../outside", "a symbolic link (to '../outside')"),
        (tarfile.SYMTYPE, "inside", "a symbolic link (to 'inside')"),
        (tarfile.LNKTYPE, "/etc/passwd", "a hard link (to '/etc/passwd')"),
        (tarfile.LNKTYPE, "fine", "a hard link (to 'fine')"),
        (tarfile.CHRTYPE, "", "a character device"),
        (tarfile.BLKTYPE, "", "a block device"),
        (tarfile.FIFOTYPE, "", "a fifo"),
        (b"V", "", "tar type 'V'"),
    ],
    ids=["abs-symlink", "escaping-symlink", "inner-symlink", "hardlink-passwd", "hardlink", "chr", "blk", "fifo", "V"],
)
def test_links_devices_and_fifos_are_refused_one_warning_each(box, kind, link, why):
    done, warnings = unpack(box.dest, stream(member("fine", data=b"ok"), member("it", kind, link=link)))
    assert len(warnings) == 1 and warnings[0][0] == "it" and warnings[0][1].startswith(why)
    assert (done.written, done.refused) == (1, 1)
    assert box.inside() == {"fine": (stat.S_IFREG, b"ok")}
    assert box.untouched()


def test_a_file_through_a_symlink_of_the_same_stream_lands_inside_dest(box):
    data = stream(member("link", tarfile.SYMTYPE, link=str(box.outside)), member("link/pwned", data=b"x"))
    done, warnings = unpack(box.dest, data)
    assert [name for name, _ in warnings] == ["link"] and (done.written, done.refused) == (1, 1)
    assert box.inside() == {"link": (stat.S_IFDIR, None), "link/pwned": (stat.S_IFREG, b"x")}
    assert box.untouched()


def test_two_copies_into_one_dest_never_walk_a_link(box):
    """The CVE-2025-4517 shape: the job author lays out links in the workspace for the first copy, then changes
    it so the second copy's members go through them. The first copy makes no link; a link in DEST from
    anywhere else (an older cp, the person) is refused per member by the second, never followed."""
    first = stream(
        member("w", tarfile.DIRTYPE, mode=0o755),
        member("w/" + "d" * 200, tarfile.SYMTYPE, link="."),
        member("w/up", tarfile.SYMTYPE, link="../../outside"),
    )
    done, warnings = unpack(box.dest, first)
    assert done.refused == 2 and no_link_made_below(box.dest)
    second = stream(member("w/up/canary", data=b"pwned"), member("w/" + "d" * 200 + "/up/x", data=b"pwned"))
    done, warnings = unpack(box.dest, second, merge=True)
    assert warnings == [] and box.untouched()  # made as plain directories inside DEST
    assert (box.dest / "w" / "up" / "canary").read_bytes() == b"pwned"

    (box.dest / "v").symlink_to(box.outside)  # a link already in DEST
    third = stream(member("v/canary", data=b"pwned"), member("v/new", data=b"pwned"), member("v", tarfile.DIRTYPE))
    done, warnings = unpack(box.dest, third, merge=True)
    assert [why for _, why in warnings] == ["'v' is a symbolic link in DEST (never followed or replaced)"] * 3
    assert box.untouched() and (box.outside / "canary").read_text() == "canary"


def test_merge_never_overwrites_an_existing_name(box):
    unpack(box.dest, stream(member("logs", tarfile.DIRTYPE), member("logs/a", data=b"first")))
    (box.dest / "logs" / "hard").hardlink_to(box.outside / "canary")
    data = stream(
        member("logs", tarfile.DIRTYPE),
        member("logs/a", data=b"second"),
        member("logs/hard", data=b"second"),
        member("logs/a/x", data=b"second"),
        member("logs/b", data=b"second"),
    )
    done, warnings = unpack(box.dest, data, merge=True)
    assert warnings == [
        ("logs/a", "'logs/a' already exists in DEST (never overwritten)"),
        ("logs/hard", "'logs/hard' already exists in DEST (never overwritten)"),
        ("logs/a/x", "'logs/a' already exists in DEST (never overwritten)"),
    ]
    assert (done.written, done.refused) == (1, 3)
    assert (box.dest / "logs" / "a").read_bytes() == b"first" and (box.dest / "logs" / "b").read_bytes() == b"second"
    assert box.untouched()


def test_the_same_name_twice_in_one_stream_keeps_the_first(box):
    done, warnings = unpack(box.dest, stream(member("f", data=b"one"), member("f", data=b"two")))
    assert warnings == [("f", "'f' already exists in DEST (never overwritten)")] and done.written == 1
    assert (box.dest / "f").read_bytes() == b"one"


def test_modes_lose_setuid_setgid_sticky_and_group_other_write(box):
    data = stream(
        member("suid", data=b"x", mode=0o4777),
        member("gw", data=b"x", mode=0o666),
        member("ro", data=b"x", mode=0o400),
        member("d", tarfile.DIRTYPE, mode=0o3777),
        member("rodir", tarfile.DIRTYPE, mode=0o555),
        member("rodir/inside", data=b"x", mode=0o644),
    )
    done, warnings = unpack(box.dest, data)
    assert warnings == [] and done.written == 6
    modes = {p.name: p.stat().st_mode & 0o7777 for p in box.dest.rglob("*")}
    assert modes == {"suid": 0o755, "gw": 0o644, "ro": 0o400, "d": 0o755, "rodir": 0o755, "inside": 0o644}


# --- the stream itself ---------------------------------------------------------------------------------------
class Lazy(io.RawIOBase):
    """A stream of `parts`, made as it is read (nothing held whole)."""

    def __init__(self, *parts: Iterable[bytes]) -> None:
        self.parts: Iterator[bytes] = itertools.chain.from_iterable(parts)
        self.buf = b""
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        while len(self.buf) < n:
            part = next(self.parts, b"")
            if not part:
                break
            self.buf += part
        out, self.buf = self.buf[:n], self.buf[n:]
        self.consumed += len(out)
        return out


def filler(n: int) -> Iterator[bytes]:
    piece = b"a" * 65536
    while n > 0:
        yield piece[: min(n, len(piece))]
        n -= len(piece)


def extract_lazy(dest: Path, source: Lazy) -> tuple[untar.Extracted, list[tuple[str, str]], int]:
    warnings: list[tuple[str, str]] = []
    dest.mkdir()
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    tracemalloc.start()
    try:
        done = untar.extract(source, fd, lambda name, why: warnings.append((name, why)))
        return done, warnings, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        os.close(fd)


def test_a_huge_pax_header_is_refused_before_it_is_read(tmp_path):
    size = untar.MAX_EXTENDED + 1
    source = Lazy([header(b"PaxHeader", b"x", size)], filler(size + 511), [END])
    with pytest.raises(untar.UntarError, match=r"a pax header of 1048577 bytes \(the limit is 1048576\)"):
        extract_lazy(tmp_path / "dest", source)
    assert source.consumed == 512


def test_a_huge_gnu_long_name_skips_its_member_in_bounded_memory(tmp_path):
    size = 64 << 20
    head = header(b"././@LongLink", b"L", size, magic=b"ustar  \0")
    tail = header(b"long", b"0", 2, magic=b"ustar  \0") + padded(b"xx") + header(b"ok", b"0", 0) + END
    done, warnings, peak = extract_lazy(tmp_path / "dest", Lazy([head], filler(size), [tail]))
    assert warnings == [("long", "a GNU long name of 67108864 bytes (the limit is 4096)")]
    assert (done.written, done.refused) == (1, 1) and os.listdir(tmp_path / "dest") == ["ok"]
    assert peak < 1 << 20


def test_many_pax_headers_keep_only_the_keys_read_in_bounded_memory(tmp_path):
    def one(i: int) -> bytes:
        record = pax(**{f"SCHILY.xattr.user.k{i}.{j}": b"v" * 4000 for j in range(200)})
        return header(b"PaxHeader", b"x", len(record)) + padded(record)

    headers = (one(i) for i in range(50))  # 40 MB of distinct keys, were they all kept
    done, warnings, peak = extract_lazy(tmp_path / "dest", Lazy(headers, [header(b"f", b"0", 0), END]))
    assert warnings == [] and done.written == 1
    assert peak < 4 << 20


def test_a_large_file_is_copied_in_bounded_memory(tmp_path):
    size = 64 << 20
    done, warnings, peak = extract_lazy(tmp_path / "dest", Lazy([header(b"big", b"0", size)], filler(size), [END]))
    assert warnings == [] and done.written == 1
    assert (tmp_path / "dest" / "big").stat().st_size == size
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("cut", "said"),
    [
        (lambda data: data[:700], "ends inside the data of 'f'"),
        (lambda data: data[:1024], "ends inside the data of 'f'"),
        (lambda data: data[: 1536 + 100], "ends inside a header"),
        (lambda data: data[:1536], "without tar's end-of-archive block"),
        (lambda data: b"", "without tar's end-of-archive block"),
        (lambda data: b"tar: logs: Cannot stat: No such file or directory\n" + bytes(500), "not a tar stream"),
        (lambda data: data[:148] + b"0000000\0" + data[156:], "not a tar stream"),
    ],
    ids=["mid-data", "mid-padding", "mid-header", "no-end", "empty", "not-tar", "checksum"],
)
def test_a_cut_or_corrupt_stream_is_one_untar_error(box, cut, said):
    data = stream(member("f", data=b"x" * 600), member("g", data=b"y" * 10), format=tarfile.USTAR_FORMAT)
    with pytest.raises(untar.UntarError) as raised:
        unpack(box.dest, cut(data))
    assert said in str(raised.value)
    assert box.untouched()


def test_a_size_that_is_not_octal_is_one_untar_error(box):
    with pytest.raises(untar.UntarError, match="its size b'0000000009x' is not an octal number"):
        unpack(box.dest, header(b"f", b"0", b"0000000009x\0") + END)


def test_a_corrupt_pax_record_is_one_untar_error(box):
    record = b"99 path=a\n"
    data = header(b"PaxHeader", b"x", len(record)) + padded(record) + header(b"a", b"0", 0) + END
    with pytest.raises(untar.UntarError, match="a corrupt pax header"):
        unpack(box.dest, data)


def test_pax_size_path_and_global_headers_are_honoured(box):
    glob = pax(comment=b"whatever", mtime=b"1600000000.5")
    record = pax(size=b"3000", path=b"a/b/c")
    data = (
        header(b"GlobalHead", b"g", len(glob))
        + padded(glob)
        + header(b"PaxHeader", b"x", len(record))
        + padded(record)
        + header(b"short", b"0", 0)
        + padded(b"z" * 3000)
        + header(b"next", b"0", 1)
        + padded(b"n")
        + END
    )
    done, warnings = unpack(box.dest, data)
    assert warnings == [] and done.written == 2
    assert (box.dest / "a" / "b" / "c").read_bytes() == b"z" * 3000 and (box.dest / "next").read_bytes() == b"n"
    assert (box.dest / "next").stat().st_mtime == 1600000000.5


# --- DEST ----------------------------------------------------------------------------------------------------
def test_a_missing_dest_is_made_but_not_its_parents(tmp_path):
    unpack(tmp_path / "new", stream(member("f", data=b"x")))
    assert (tmp_path / "new" / "f").read_bytes() == b"x"
    with pytest.raises(untar.UntarError, match="does not exist; create it first"):
        untar.check_dest(tmp_path / "no" / "dest", merge=False)


def test_a_dest_that_is_not_empty_needs_merge(tmp_path):
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "old").write_text("old")
    with pytest.raises(untar.UntarError, match="is not empty; give a new or empty directory, or --merge"):
        untar.check_dest(tmp_path / "dest", merge=False)
    with pytest.raises(untar.UntarError, match="is not empty"):
        untar.open_dest(tmp_path / "dest", merge=False)
    done, _ = unpack(tmp_path / "dest", stream(member("f", data=b"x")), merge=True)
    assert done.written == 1 and (tmp_path / "dest" / "old").read_text() == "old"


@pytest.mark.parametrize("merge", [False, True])
def test_a_dest_that_is_a_symlink_or_a_file_is_refused(tmp_path, merge):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("x")
    with pytest.raises(untar.UntarError, match="link is a symbolic link; cp never writes through a link"):
        untar.open_dest(tmp_path / "link", merge=merge)
    with pytest.raises(untar.UntarError, match="file exists and is not a directory"):
        untar.open_dest(tmp_path / "file", merge=merge)
    assert os.listdir(tmp_path / "real") == []


# --- anything at all -----------------------------------------------------------------------------------------
# Weighted towards what could escape: `..`, the names of links planted in DEST, files and directories.
COMPONENTS = st.sampled_from(["..", "..", "a", "link", "up", "outside", "canary", ".", "", "x" * 300, "é", "\x1b[31m"])
NAMES = st.lists(COMPONENTS, min_size=1, max_size=5).map("/".join) | st.sampled_from(["/", "/etc/passwd", "//x"])
KINDS = st.sampled_from(
    [
        tarfile.REGTYPE,
        tarfile.REGTYPE,
        tarfile.AREGTYPE,
        tarfile.CONTTYPE,
        tarfile.DIRTYPE,
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.FIFOTYPE,
        b"V",
    ]
)
LINKS = st.sampled_from(["", ".", "..", "/", "../outside", "../../outside", "/etc/passwd", "link", "a/../.."])
MEMBERS = st.lists(
    st.tuples(NAMES, KINDS, LINKS, st.binary(max_size=700), st.integers(0, 0o7777)), min_size=0, max_size=8
)
FORMATS = st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])


def hostile(members: list[tuple[str, bytes, str, bytes, int]], fmt: int) -> bytes:
    built = [
        member(name, kind, data if kind in tarfile.REGULAR_TYPES else b"", link, mode)
        for name, kind, link, data, mode in members
    ]
    return stream(*built, format=fmt)


def check_nothing_escapes(data: bytes, plant: bool, merge: bool) -> None:
    with tempfile.TemporaryDirectory() as top:
        box = Sandbox(Path(top))
        planted: set[Path] = set()
        if plant:  # DEST already holds links out of it, as an older cp could have left
            box.dest.mkdir()
            for name, target in (("link", box.outside), ("up", Path("..")), ("canary", box.outside / "canary")):
                (box.dest / name).symlink_to(target)
                planted.add(box.dest / name)
        with contextlib.suppress(untar.UntarError):  # the one exception allowed: a cut or corrupt stream
            unpack(box.dest, data, merge=merge or plant)
        assert box.untouched()
        assert no_link_made_below(box.dest, planted)


@settings(max_examples=300)
@given(MEMBERS, FORMATS, st.booleans(), st.booleans())
def test_no_stream_of_any_members_writes_outside_dest(members, fmt, plant, merge):
    check_nothing_escapes(hostile(members, fmt), plant, merge)


@settings(max_examples=300)
@given(MEMBERS, FORMATS, st.data())
def test_no_cut_or_mangled_stream_writes_outside_dest_or_raises_anything_else(members, fmt, draw):
    data = bytearray(hostile(members, fmt))
    for _ in range(draw.draw(st.integers(0, 8))):
        at = draw.draw(st.integers(0, len(data) - 1))
        data[at] = draw.draw(st.integers(0, 255))
    cut = draw.draw(st.integers(0, len(data)))
    check_nothing_escapes(bytes(data[:cut]), plant=draw.draw(st.booleans()), merge=True)


@given(st.binary(max_size=4096), st.booleans())
def test_random_bytes_are_refused_or_unpacked_inside_dest(data, plant):
    check_nothing_escapes(data, plant, merge=True)
