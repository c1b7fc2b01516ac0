package labfile

import (
	"os"
	"path/filepath"
	"testing"
)

func TestWriteAtomic(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "addr")
	for _, want := range []string{"127.0.0.1:1\n", "127.0.0.1:22\n"} {
		if err := WriteAtomic(p, want); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p)
		if err != nil || string(got) != want {
			t.Fatalf("read back %q, %v; want %q", got, err, want)
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil || len(ents) != 1 {
		t.Errorf("dir holds %v (%v), want only the file: no temporary left", ents, err)
	}
	if err := WriteAtomic(filepath.Join(dir, "missing", "f"), "x"); err == nil {
		t.Error("write into a missing directory: no error")
	}
}
