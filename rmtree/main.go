// Command sandkeep-rmtree deletes one directory tree below a directory descriptor it inherits, the way
// controller/node/fsdelete.py does in Python, with the unlinks of many goroutines in flight at once and no
// interpreter lock between them (docs/benchmarks.md, issue 31).
//
//	sandkeep-rmtree FD NAME WORKERS
//
// FD is an open directory, NAME one entry of it, WORKERS the goroutines that may remove at once (the caller's
// included). Prints one JSON line: {"files": N, "errno": E|null, "path": "NAME/..."|null, "mount": bool};
// `path` and `errno` name the first entry that would not go (`mount`: it was a directory on another mount),
// and everything else that could go is gone. Exits 0 whenever it printed that line, 2 on bad arguments.
//
// The same safety as the Python walk, step for step:
//   - every directory is opened O_DIRECTORY|O_NOFOLLOW relative to its parent's fd; a link or a file met where a
//     directory was read is unlinked, never followed;
//   - a directory whose device or mount id differs from FD's, or whose mount id cannot be read, is refused
//     (unknown is a mount), never entered;
//   - a goroutine holds at most `budget` levels open; a closed parent is reopened through "..", checked to be
//     the same inode on the same mount, else the whole delete stops (the tree moved under it);
//   - a directory this uid owns but cannot search or write gets u+rwx, once; another uid's is never changed;
//   - a level's descriptor is closed only once no goroutine works on what it handed out from it.
//
// Memory is bounded whatever the tree: a level is a small struct (its name, its parent, its inode), plus an
// 8 KiB read buffer while it is open; at most `batch` names are in hand per handed-out job; a job is only
// handed to a goroutine that waits for one (nothing queues).
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	openDir       = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	budget        = 16      // levels one goroutine holds open; a closed one is reopened through ".."
	batch         = 32      // most names of non-directories handed out at once
	first         = 4       // names handed out at first (grows to `batch` as a level keeps giving)
	bufSize       = 8192    // getdents buffer of an open level
	maxFailedDirs = 1 << 16 // directories that stay, remembered to skip on a re-read; beyond: stop
	maxWorkers    = 256
	maxPath       = 4096 // bytes of a failure's path in the answer: its deepest names past that
)

var errStop = errors.New("stop")

// level is one directory of the tree: open (fd >= 0) while a walk reads it.
type level struct {
	name      string
	parent    *level // nil: the top, whose parent is the inherited FD
	fd        int
	dev, ino  uint64
	buf       []byte
	pos, end  int
	taken     int
	descended bool           // its walk went down into one of its subdirectories: the next ones may be handed out
	inflight  atomic.Int32   // jobs handed out that still use fd
	jobs      sync.WaitGroup // the same jobs, to wait for
}

func (lv *level) close() {
	if lv.fd >= 0 {
		unix.Close(lv.fd)
		lv.fd = -1
	}
	if buf := lv.buf; buf != nil {
		buffers.Put(&buf)
	}
	lv.buf, lv.pos, lv.end = nil, 0, 0
}

// buffers are the open levels' getdents buffers, reused: a deep chain opens and closes a level per step.
var buffers = sync.Pool{New: func() any { buf := make([]byte, bufSize); return &buf }}

func (lv *level) path() string {
	var names []string
	for l := lv; l != nil; l = l.parent {
		names = append(names, l.name)
	}
	for i, j := 0, len(names)-1; i < j; i, j = i+1, j-1 {
		names[i], names[j] = names[j], names[i]
	}
	return strings.Join(names, "/")
}

type job struct {
	lv    *level   // the level the names are in, or the parent of sub
	names []string // non-directories to unlink through lv.fd
	sub   *level   // or: a directory to delete, already opened and checked
}

// deletion is what every goroutine of one delete shares.
type deletion struct {
	top      int // the inherited FD
	dev, mnt uint64
	mntKnown bool
	euid     int
	idle     chan job // unbuffered: a send succeeds only when a worker waits
	files    atomic.Int64
	stopped  atomic.Bool
	mu       sync.Mutex
	failed   bool
	errno    int
	where    string
	mount    bool
	stays    map[uint64]struct{}
	staysAny atomic.Bool // stays is not empty: only then is the lock taken to look
}

func (d *deletion) fail(code unix.Errno, where string, mount bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.failed {
		d.failed, d.errno, d.where, d.mount = true, int(code), shorten(where), mount
	}
}

// shorten keeps a failure's path within maxPath bytes: ".../" and its deepest names (the answer stays one short
// line, however deep the tree).
func shorten(path string) string {
	if len(path) <= maxPath {
		return path
	}
	tail := path[len(path)-maxPath+3:]
	if i := strings.IndexByte(tail, '/'); i >= 0 {
		tail = tail[i:]
	}
	return "..." + tail
}

// stay remembers a directory that will not go, so a re-read of its parent does not enter it again.
func (d *deletion) stay(ino uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stays[ino] = struct{}{}
	d.staysAny.Store(true)
	if len(d.stays) > maxFailedDirs {
		return errStop
	}
	return nil
}

func (d *deletion) staying(ino uint64) bool {
	if !d.staysAny.Load() {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.stays[ino]
	return ok
}

// errnoOf is the errno of a failed system call (EIO for anything else, which none of the calls here returns).
func errnoOf(err error) unix.Errno {
	var code unix.Errno
	if errors.As(err, &code) {
		return code
	}
	return unix.EIO
}

func join(lv *level, name string) string {
	if lv == nil {
		return name
	}
	return lv.path() + "/" + name
}

// identify reads a descriptor's device, inode and mount id (statx; /proc/self/fdinfo where statx has no mount
// id). A variable: the tests make a mount unknown.
var identify = func(fd int) (dev, ino, mnt uint64, mntKnown bool, err error) {
	var st unix.Statx_t
	err = unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS|unix.STATX_MNT_ID, &st)
	if err != nil {
		return
	}
	dev, ino = unix.Mkdev(st.Dev_major, st.Dev_minor), st.Ino
	if st.Mask&unix.STATX_MNT_ID != 0 {
		return dev, ino, st.Mnt_id, true, nil
	}
	mnt, mntKnown = fdinfoMount(fd)
	return dev, ino, mnt, mntKnown, nil
}

func fdinfoMount(fd int) (uint64, bool) {
	data, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(fd))
	if err != nil {
		return 0, false
	}
	for _, line := range bytes.Split(data, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("mnt_id:")); ok {
			n, err := strconv.ParseUint(string(bytes.TrimSpace(v)), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// walk is one goroutine's part: the levels it holds open, shallowest first.
type walk struct {
	d    *deletion
	open []*level
}

func dirFd(d *deletion, lv *level) int {
	if lv == nil {
		return d.top
	}
	return lv.fd
}

// enter opens `name` below `parent` as a directory; nil when not to descend (it went, it stays, it failed).
func (w *walk) enter(parent *level, name string, ino uint64, retried bool) (*level, error) {
	d := w.d
	if beforeOpen != nil {
		beforeOpen(dirFd(d, parent), name)
	}
	fd, err := unix.Openat(dirFd(d, parent), name, openDir, 0)
	if err != nil {
		switch {
		case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR):
			w.unlink(parent, name, false) // a link or a file now: unlink it, never follow it
		case errors.Is(err, unix.ENOENT):
		case errors.Is(err, unix.EACCES) && !retried && w.makeSearchable(dirFd(d, parent), name):
			return w.enter(parent, name, ino, true)
		default:
			d.fail(errnoOf(err), join(parent, name), false)
			if ino != 0 {
				return nil, d.stay(ino)
			}
		}
		return nil, nil
	}
	dev, sino, mnt, known, err := identify(fd)
	if err != nil {
		unix.Close(fd)
		d.fail(errnoOf(err), join(parent, name), false)
		return nil, nil
	}
	if dev != d.dev || !d.mntKnown || !known || mnt != d.mnt {
		unix.Close(fd)
		d.fail(unix.EXDEV, join(parent, name), true)
		return nil, d.stay(sino)
	}
	return &level{name: name, parent: parent, fd: fd, dev: dev, ino: sino}, nil
}

// makeSearchable gives u+rwx to a directory this uid owns but cannot open, through an O_PATH descriptor.
func (w *walk) makeSearchable(dir int, name string) bool {
	fd, err := unix.Openat(dir, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	mode, ok := w.repaired(fd)
	return ok && unix.Chmod("/proc/self/fd/"+strconv.Itoa(fd), mode) == nil
}

// makeWritable gives u+rwx to an open directory this uid owns and cannot write.
func (w *walk) makeWritable(lv *level) bool {
	if lv == nil || lv.fd < 0 {
		return false
	}
	mode, ok := w.repaired(lv.fd)
	return ok && unix.Fchmod(lv.fd, mode) == nil
}

// repaired is the mode with u+rwx for a directory this uid owns and lacks some of it; false for any other
// (another uid's is never changed).
func (w *walk) repaired(fd int) (uint32, bool) {
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || int(st.Uid) != w.d.euid || st.Mode&0o700 == 0o700 {
		return 0, false
	}
	return st.Mode&0o7777 | 0o700, true
}

// unlink removes one non-directory; false when it is a directory (the caller descends).
func (w *walk) unlink(lv *level, name string, retried bool) bool {
	d := w.d
	err := unix.Unlinkat(dirFd(d, lv), name, 0)
	switch {
	case err == nil:
		d.files.Add(1)
	case errors.Is(err, unix.ENOENT):
	case errors.Is(err, unix.EISDIR):
		return false
	case errors.Is(err, unix.EACCES) && !retried && w.makeWritable(lv):
		return w.unlink(lv, name, true)
	default:
		d.fail(errnoOf(err), join(lv, name), false)
	}
	return true
}

// unlinkNames removes names taken from lv; one that turned out to be a directory is deleted right here.
func (w *walk) unlinkNames(lv *level, names []string) error {
	if beforeUnlinks != nil {
		beforeUnlinks(lv.fd, names)
	}
	for _, name := range names {
		if w.unlink(lv, name, false) {
			continue
		}
		sub, err := w.enter(lv, name, 0, false)
		if err != nil {
			return err
		}
		if sub != nil { // a walk of its own: drain closes what its walk holds when it stops
			if err := (&walk{d: w.d}).drain(sub); err != nil {
				return err
			}
		}
	}
	return nil
}

// next is the next entry of lv (read again from the start if lv was closed and reopened); ok false at its end.
func (w *walk) next(lv *level) (name string, isDir bool, ino uint64, ok bool, err error) {
	for {
		if lv.pos >= lv.end {
			if lv.buf == nil {
				lv.buf = *buffers.Get().(*[]byte)
			}
			n, err := unix.Getdents(lv.fd, lv.buf)
			if err != nil {
				return "", false, 0, false, err
			}
			if n <= 0 {
				return "", false, 0, false, nil
			}
			lv.pos, lv.end = 0, n
		}
		// struct linux_dirent64 { u64 d_ino; s64 d_off; u16 d_reclen; u8 d_type; char d_name[]; }
		rec := lv.buf[lv.pos:lv.end]
		reclen := int(*(*uint16)(unsafe.Pointer(&rec[16])))
		ino = *(*uint64)(unsafe.Pointer(&rec[0]))
		typ := rec[18]
		raw := rec[19:reclen]
		lv.pos += reclen
		if i := bytes.IndexByte(raw, 0); i >= 0 {
			raw = raw[:i]
		}
		name = string(raw)
		if name == "." || name == ".." {
			continue
		}
		return name, typ == unix.DT_DIR, ino, true, nil
	}
}

// push takes lv into this walk's open levels; over budget the shallowest one no job uses is closed.
func (w *walk) push(lv *level) {
	w.open = append(w.open, lv)
	if len(w.open) <= budget {
		return
	}
	for i, l := range w.open[:len(w.open)-1] {
		if l.inflight.Load() == 0 {
			l.close()
			w.open = append(w.open[:i], w.open[i+1:]...)
			return
		}
	}
}

// backToParent takes lv out of the open levels and makes sure its parent is open (through "..", checked).
func (w *walk) backToParent(lv *level) error {
	if n := len(w.open); n > 0 && w.open[n-1] == lv {
		w.open = w.open[:n-1]
	}
	parent := lv.parent
	if parent == nil || parent.fd >= 0 {
		return nil
	}
	fd, err := unix.Openat(lv.fd, "..", openDir, 0)
	if err != nil {
		w.d.fail(errnoOf(err), parent.path(), false)
		return errStop
	}
	// ".." lands on top of whatever was mounted on the parent since: the same inode is not enough
	dev, ino, mnt, known, err := identify(fd)
	if err != nil || dev != parent.dev || ino != parent.ino || !known || mnt != w.d.mnt {
		unix.Close(fd)
		w.d.fail(unix.ESTALE, parent.path(), false)
		return errStop
	}
	parent.fd = fd
	w.open = append([]*level{parent}, w.open...)
	return nil
}

// leave rmdirs a read-out level from its parent, then closes it (after: its inode is freed outside the
// parent's lock, so siblings' rmdirs do not queue behind it).
func (w *walk) leave(lv *level) error {
	if err := w.backToParent(lv); err != nil {
		lv.close()
		return err
	}
	defer lv.close()
	parentFd := dirFd(w.d, lv.parent)
	err := unix.Unlinkat(parentFd, lv.name, unix.AT_REMOVEDIR)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if errors.Is(err, unix.EACCES) && w.makeWritable(lv.parent) {
		if unix.Unlinkat(parentFd, lv.name, unix.AT_REMOVEDIR) == nil {
			return nil
		}
	}
	w.d.fail(errnoOf(err), lv.path(), false)
	return w.d.stay(lv.ino)
}

// hand gives a job to a goroutine that waits for one; false when none does (the caller does it itself).
func (w *walk) hand(lv *level, j job) bool {
	lv.inflight.Add(1)
	lv.jobs.Add(1)
	select {
	case w.d.idle <- j:
		return true
	default:
		lv.inflight.Add(-1)
		lv.jobs.Done()
		return false
	}
}

// drain deletes everything below top, then top itself: depth-first in this goroutine, handing batches of
// names and whole subdirectories to goroutines that wait for work.
func (w *walk) drain(top *level) (err error) {
	w.push(top)
	lv := top
	var names []string
	defer func() {
		for len(w.open) > 0 { // stopped: wait for what was handed out, then close
			l := w.open[len(w.open)-1]
			w.open = w.open[:len(w.open)-1]
			l.jobs.Wait()
			l.close()
		}
	}()
	flush := func() error {
		if len(names) == 0 {
			return nil
		}
		taken := names
		names = nil
		if w.hand(lv, job{lv: lv, names: taken}) {
			return nil
		}
		return w.unlinkNames(lv, taken)
	}
	for {
		if w.d.stopped.Load() {
			return errStop
		}
		name, isDir, ino, ok, rerr := w.next(lv)
		if rerr != nil {
			w.d.fail(errnoOf(rerr), lv.path(), false)
			ok = false
		}
		if ok && !isDir {
			names = append(names, name)
			lv.taken++
			if len(names) >= min(batch, max(first, lv.taken>>2)) {
				if err := flush(); err != nil {
					return err
				}
			}
			continue
		}
		if err := flush(); err != nil { // the names in hand are lv's: unlinked before leaving it for a child
			return err
		}
		if ok {
			if w.d.staying(ino) {
				continue
			}
			sub, err := w.enter(lv, name, ino, false)
			if err != nil {
				return err
			}
			if sub == nil {
				continue
			}
			// a level's first subdirectory stays with its walk (a chain stays with the walk that holds it open,
			// whose files go out in batches); the next ones go to a goroutine that waits, if one does
			if lv.descended && w.hand(lv, job{lv: lv, sub: sub}) {
				continue
			}
			lv.descended = true
			w.push(sub)
			lv = sub
			continue
		}
		// lv is read out: wait for what was handed out, then rmdir it
		lv.jobs.Wait()
		parent := lv.parent
		if err := w.leave(lv); err != nil {
			return err
		}
		if lv == top {
			return nil
		}
		lv = parent // reopened through "..": read again from the start; still open: read on
	}
}

func (d *deletion) serve() {
	for j := range d.idle {
		w := &walk{d: d}
		var err error
		if j.sub != nil {
			err = w.drain(j.sub)
		} else {
			err = w.unlinkNames(j.lv, j.names)
		}
		if err != nil {
			d.stopped.Store(true)
		}
		j.lv.inflight.Add(-1)
		j.lv.jobs.Done()
	}
}

type result struct {
	Files int64   `json:"files"`
	Errno *int    `json:"errno"`
	Path  *string `json:"path"`
	Mount bool    `json:"mount"`
}

// Hooks for the tests (main_test.go) to change the tree between two steps; nil in the command.
var (
	beforeUnlinks func(dir int, names []string)
	beforeOpen    func(dir int, name string)
)

// run deletes `name` below the open directory fd with `workers` goroutines at most.
func run(fd int, name string, workers int) (result, error) {
	dev, _, mnt, known, err := identify(fd)
	if err != nil {
		return result{}, fmt.Errorf("descriptor %d: %w", fd, err)
	}
	d := &deletion{top: fd, dev: dev, mnt: mnt, mntKnown: known, euid: os.Geteuid(), idle: make(chan job),
		stays: map[uint64]struct{}{}}
	var serving sync.WaitGroup
	for range workers - 1 {
		serving.Go(d.serve)
	}
	w := &walk{d: d}
	if sub, err := w.enter(nil, name, 0, false); err == nil && sub != nil {
		w.drain(sub)
	}
	close(d.idle)
	serving.Wait()
	out := result{Files: d.files.Load(), Mount: d.mount}
	if d.failed {
		out.Errno, out.Path = &d.errno, &d.where
	}
	return out, nil
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: sandkeep-rmtree FD NAME WORKERS")
		os.Exit(2)
	}
	fd, err1 := strconv.Atoi(os.Args[1])
	name := os.Args[2]
	workers, err2 := strconv.Atoi(os.Args[3])
	if err1 != nil || err2 != nil || fd < 0 || workers < 1 || workers > maxWorkers ||
		name == "" || name == "." || name == ".." || strings.Contains(name, "/") {
		fmt.Fprintf(os.Stderr, "sandkeep-rmtree: bad arguments %q\n", os.Args[1:])
		os.Exit(2)
	}
	// the caller's death ends the delete: a new agent starts it again, and two deletes never race
	unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0)
	out, err := run(fd, name, workers)
	if err != nil {
		fmt.Fprintf(os.Stderr, "sandkeep-rmtree: %v\n", err)
		os.Exit(2)
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
