package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// The races and refusals of tests/disk/test_fsdelete*.py that need a step between two of the walker's: here
// through its hooks. Everything else is tested through the Python API with both walkers (the `engine` fixture).

func write(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// bait is a directory outside the tree that must survive whatever the delete meets.
func bait(t *testing.T, root string) string {
	dir := filepath.Join(root, "bait")
	write(t, filepath.Join(dir, "keep.txt"))
	return dir
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func del(t *testing.T, root, name string, workers int) result {
	t.Helper()
	fd, err := unix.Open(root, openDir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	out, err := run(fd, name, workers)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func hooked(t *testing.T, unlinks func(int, []string), open func(int, string)) {
	beforeUnlinks, beforeOpen = unlinks, open
	t.Cleanup(func() { beforeUnlinks, beforeOpen = nil, nil })
}

func TestAFileSwappedForADirectoryBeforeItsBatchIsUnlinkedIsDescendedInto(t *testing.T) {
	root := t.TempDir()
	keep := bait(t, root)
	const files = 101
	for i := range files {
		write(t, filepath.Join(root, "t", fmt.Sprintf("f%05d", i)))
	}
	var once sync.Once
	hooked(t, func(dir int, batch []string) {
		once.Do(func() {
			name := batch[len(batch)-1]
			inside := fmt.Sprintf("/proc/self/fd/%d/%s", dir, name)
			if err := unix.Unlinkat(dir, name, 0); err != nil {
				t.Error(err)
			}
			if err := unix.Mkdirat(dir, name, 0o755); err != nil {
				t.Error(err)
			}
			if err := os.Symlink(keep, inside+"/to-bait"); err != nil {
				t.Error(err)
			}
			write(t, inside+"/inner")
		})
	}, nil)
	out := del(t, root, "t", 4)
	if out.Path != nil || out.Files != files-1+2 {
		t.Fatalf("%+v %v %v", out, deref(out.Errno), deref(out.Path))
	}
	if got := names(t, root); len(got) != 1 || got[0] != "bait" || len(names(t, keep)) != 1 {
		t.Fatalf("left %v, bait %v", got, names(t, keep))
	}
}

func TestADirectorySwappedForALinkBeforeItIsOpenedIsUnlinkedNeverFollowed(t *testing.T) {
	root := t.TempDir()
	keep := bait(t, root)
	for d := range 24 {
		for i := range 40 {
			write(t, filepath.Join(root, "t", fmt.Sprintf("s%d", d), "inner", fmt.Sprintf("f%d", i)))
		}
	}
	away := filepath.Join(root, "moved-away")
	var once sync.Once
	hooked(t, nil, func(dir int, name string) {
		if name != "inner" {
			return
		}
		once.Do(func() {
			inner := fmt.Sprintf("/proc/self/fd/%d/inner", dir)
			if err := os.Rename(inner, away); err != nil {
				t.Error(err)
			}
			if err := os.Symlink(keep, inner); err != nil {
				t.Error(err)
			}
		})
	})
	out := del(t, root, "t", 4)
	if out.Path != nil {
		t.Fatalf("%+v %v %v", out, deref(out.Errno), deref(out.Path))
	}
	if len(names(t, keep)) != 1 || len(names(t, away)) != 40 { // moved out before it was entered: not ours
		t.Fatalf("bait %v, moved away %d", names(t, keep), len(names(t, away)))
	}
}

func TestADirectoryWhoseMountCannotBeKnownIsTreatedAsAMount(t *testing.T) {
	root := t.TempDir()
	write(t, filepath.Join(root, "t", "d", "f"))
	real := identify
	identify = func(fd int) (dev, ino, mnt uint64, known bool, err error) {
		dev, ino, mnt, _, err = real(fd)
		return dev, ino, mnt, false, err
	}
	t.Cleanup(func() { identify = real })
	out := del(t, root, "t", 4)
	if !out.Mount || out.Path == nil || *out.Path != "t" || *out.Errno != int(unix.EXDEV) {
		t.Fatalf("%+v %v %v", out, deref(out.Errno), deref(out.Path))
	}
	if len(names(t, filepath.Join(root, "t", "d"))) != 1 {
		t.Fatal("a file below a refused directory went")
	}
}

// A level closed by the descriptor budget is reopened through ".."; once the tree above moved away, ".." is
// another directory and the whole delete stops without touching it.
func TestAParentThatMovedAwayStopsTheDeleteBeforeItsNewParentIsTouched(t *testing.T) {
	root := t.TempDir()
	elsewhere := filepath.Join(root, "elsewhere")
	write(t, filepath.Join(elsewhere, "keep.txt"))
	chain := filepath.Join(root, "t")
	for i := range 3 * budget {
		chain = filepath.Join(chain, fmt.Sprintf("a%d", i))
	}
	write(t, filepath.Join(chain, "f"))
	moved := filepath.Join(root, "t", "a0", "a1", "a2")
	var once sync.Once
	hooked(t, func(int, []string) {
		once.Do(func() { // at the bottom: every shallow level is closed by now
			if err := os.Rename(moved, filepath.Join(elsewhere, "a2")); err != nil {
				t.Error(err)
			}
		})
	}, nil)
	out := del(t, root, "t", 1)
	if out.Path == nil || *out.Errno != int(unix.ESTALE) {
		t.Fatalf("%+v %v %v", out, deref(out.Errno), deref(out.Path))
	}
	if got := names(t, elsewhere); len(got) != 2 {
		t.Fatalf("the moved-away tree's new parent was touched: %v", got)
	}
	if len(names(t, filepath.Join(root, "t", "a0", "a1"))) != 0 {
		t.Fatal("what stayed in the tree should be read out")
	}
}

func TestAChainDeeperThanTheBudgetHoldsAtMostTheBudgetOpen(t *testing.T) {
	root := t.TempDir()
	chain := filepath.Join(root, "t")
	for i := range 10 * budget {
		chain = filepath.Join(chain, fmt.Sprintf("a%d", i))
	}
	write(t, filepath.Join(chain, "f"))
	most := 0
	hooked(t, nil, func(int, string) {
		if n := len(names(t, "/proc/self/fd")); n > most {
			most = n
		}
	})
	before := len(names(t, "/proc/self/fd"))
	if out := del(t, root, "t", 1); out.Path != nil || out.Files != 1 {
		t.Fatalf("%+v %v %v", out, deref(out.Errno), deref(out.Path))
	}
	if most-before > budget+3 { // the levels, the caller's descriptor, ReadDir's own
		t.Fatalf("%d descriptors open at once for a %d-level chain", most-before, 10*budget)
	}
	if after := len(names(t, "/proc/self/fd")); after != before {
		t.Fatalf("%d descriptors left open", after-before)
	}
}

func deref[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}

func TestAFailuresPathIsShortenedToItsDeepestNames(t *testing.T) {
	if got := shorten("t/a/b"); got != "t/a/b" {
		t.Fatal(got)
	}
	long := "t" + strings.Repeat("/"+strings.Repeat("d", 255), 40) + "/last"
	got := shorten(long)
	if len(got) > maxPath || !strings.HasPrefix(got, ".../") || !strings.HasSuffix(got, "/last") {
		t.Fatalf("%d bytes: %.40s...%s", len(got), got, got[len(got)-20:])
	}
	if !strings.HasSuffix(long, got[3:]) {
		t.Fatal("not the path's own tail")
	}
}
