package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/kvm2"
)

// fileConfig is the config file: the kvm2 entries an embedder would give
// kvm2.Open, one per hypervisor.
type fileConfig struct {
	Entries []kvm2.Config
}

// loadConfig reads and checks the config file with kvm2.ParseEntries:
// strictly (a typo must not silently drop a setting), every entry checked
// as kvm2.Open checks it, every problem reported at once with its key path
// and line.
func loadConfig(path string) (*fileConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, usagef("config: %v", err)
	}
	entries, err := kvm2.ParseEntries(data, nil)
	if err != nil {
		return nil, usagef("%s: %s", path, problemList(err))
	}
	return &fileConfig{Entries: entries}, nil
}

// problemList is err's problems one per line, or err's text when it names
// no field (a YAML syntax error).
func problemList(err error) string {
	fes := egressproxy.FieldErrors(err)
	if len(fes) < 2 {
		return err.Error()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d problems:", len(fes))
	for _, fe := range fes {
		b.WriteString("\n  " + fe.Error())
	}
	return b.String()
}
