package labfile

import (
	"os"
	"path/filepath"
)

// WriteAtomic writes content to path through a temporary file in the same
// directory and a rename, so that a script polling path reads either
// nothing or all of content.
func WriteAtomic(path, content string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	if _, err := tmp.WriteString(content); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}
