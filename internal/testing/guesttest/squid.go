package guesttest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// Squid returns the path of the squid binary. Without one it skips the
// test, except under CI=true, where the test stack installs Squid and its
// absence fails the test.
func Squid(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"squid", "/usr/sbin/squid"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	if teststack.InCI() {
		t.Fatal("CI=true: squid is not installed (scripts/teststack deps installs it)")
	}
	t.Skip("squid is not installed: `squid -k parse` cannot check the configuration (scripts/teststack deps installs it)")
	return ""
}

// SquidParse writes the files userData's write_files hold under a
// temporary root (paths under /etc/squid/ moved there, in squid.conf too)
// and runs `squid -k parse` on its squid.conf. It fails t when Squid
// refuses the configuration or prints a warning or an error about it.
func SquidParse(t testing.TB, squid, userData string) {
	t.Helper()
	var cc struct {
		WriteFiles []struct {
			Path    string `yaml:"path"`
			Content string `yaml:"content"`
		} `yaml:"write_files"`
	}
	if err := yaml.Unmarshal([]byte(userData), &cc); err != nil {
		t.Fatalf("user-data is not YAML: %v", err)
	}
	root := t.TempDir()
	move := func(s string) string { return strings.ReplaceAll(s, "/etc/squid/", root+"/etc/squid/") }
	conf := ""
	for _, f := range cc.WriteFiles {
		p := move(f.Path)
		if !strings.HasPrefix(p, root) {
			t.Fatalf("user-data writes %s, outside /etc/squid/", f.Path)
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		content := f.Content
		if strings.HasSuffix(f.Path, "/squid.conf") {
			content = move(content)
			conf = p
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if conf == "" {
		t.Fatal("user-data writes no squid.conf")
	}
	out, err := exec.Command(squid, "-k", "parse", "-f", conf).CombinedOutput()
	if err != nil {
		t.Fatalf("squid -k parse refused the configuration: %v\n%s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "WARNING") || strings.Contains(line, "ERROR") || strings.Contains(line, "FATAL") {
			t.Fatalf("squid -k parse: %s\n(whole output:\n%s)", line, out)
		}
	}
}
