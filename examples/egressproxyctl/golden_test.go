package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

var update = flag.Bool("update", false, "rewrite testdata/**/*.golden from the program's output")

// golden compares got with testdata/name.golden (go test -update rewrites
// it).
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test -run '%s' -update writes it)", err, t.Name())
	}
	if diff := cmp.Diff(string(want), got); diff != "" {
		t.Errorf("%s differs (-want +got; go test -run '%s' -update rewrites it):\n%s", path, t.Name(), diff)
	}
}

// goldenWorld is a world whose output is the same at every run: proxies
// without listeners (documentation addresses), a fixed clock, a fixed
// build.
func goldenWorld(t *testing.T) *world {
	t.Helper()
	w := newWorld(t, "lab1", "lab2")
	w.opts.ServeProxies = false
	created := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
	w.opts.Now = func() time.Time { return created }
	w.now = func() time.Time { return created.Add(3*time.Hour + 20*time.Minute) }
	w.buildInfo = func() (*debug.BuildInfo, bool) {
		return &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/egressproxy/egressproxy", Version: "v0.4.0"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "0c4f2d9a1b7e"}, {Key: "vcs.time", Value: "2026-12-01T08:00:00Z"}, {Key: "vcs.modified", Value: "false"}}}, true
	}
	w.images["lab1"] = &fakeImages{present: map[string]bool{"base": true}, corrupt: map[string]bool{}}
	return w
}

// transcript runs each command line and writes what a terminal would
// show: the line, then stdout, stderr and the exit code when not 0, with
// the config's path as CONFIG.
func (w *world) transcript(lines ...[]string) string {
	w.t.Helper()
	var b strings.Builder
	for _, args := range lines {
		code, out, errs := w.runT(args...)
		fmt.Fprintf(&b, "$ egressproxyctl %s\n%s", strings.Join(args, " "), out)
		if errs != "" {
			fmt.Fprintf(&b, "[stderr]\n%s", errs)
		}
		if code != exitOK {
			fmt.Fprintf(&b, "[exit %d]\n", code)
		}
		b.WriteString("\n")
	}
	return strings.ReplaceAll(b.String(), w.config, "CONFIG")
}

// Every command's help: on stdout, exit 0, the same whether asked as
// --help, -h or "help COMMAND".
func TestGoldenHelp(t *testing.T) {
	w := newWorld(t, "lab1")
	for _, cmd := range [][]string{
		nil, {"check"}, {"ls"}, {"create"}, {"delete"}, {"probe"}, {"gc"}, {"images"},
		{"images", "ls"}, {"images", "verify"}, {"images", "evict"}, {"version"}, {"completion"}, {"config"}, {"help"},
	} {
		name := strings.Join(cmd, "-")
		if name == "" {
			name = "egressproxyctl"
		}
		t.Run(name, func(t *testing.T) {
			code, out, errs := w.runT(append(append([]string{}, cmd...), "--help")...)
			if code != exitOK || errs != "" || out == "" {
				t.Fatalf("%v --help: exit %d, stderr %q, stdout %d bytes; want 0, nothing, the help", cmd, code, errs, len(out))
			}
			golden(t, "help/"+name, out)
			asked := [][]string{append(append([]string{}, cmd...), "-h"), append([]string{"help"}, cmd...)}
			if cmd == nil {
				asked = append(asked, []string{}) // no command at all
			}
			for _, args := range asked {
				if code, o, e := w.runT(args...); code != exitOK || e != "" || o != out {
					t.Errorf("%q: exit %d, stderr %q, stdout differs from --help's: %v", args, code, e, o != out)
				}
			}
			if strings.Contains(out, "scripts/") || strings.Contains(out, "teststack") {
				t.Errorf("the help names a script of the repository:\n%s", out)
			}
		})
	}
}

// Bad command lines: one plain message on stderr (a bad flag or argument
// with a pointer to the command's --help), nothing on stdout, exit 2.
func TestGoldenErrors(t *testing.T) {
	w := newWorld(t, "lab1", "lab2")
	var lines [][]string
	for _, line := range []string{
		"-timeout 5 ls",
		"ls --bogus",
		"ls -x",
		"ls -o xml",
		"ls --output",
		"ls --timeout x",
		"ls -v many",
		"ls --timeout -1s",
		"ls extra",
		"lss",
		"frobnicate",
		"delete",
		"delete a b",
		"delete Proxy_A",
		"delete lab1/proxy-a --entry lab2",
		"create proxy-a",
		"create Proxy_A --uid u --port 70000",
		"create proxy-a --uid u --wait -1s",
		"create proxy-a --uid u",
		"create proxy-a --uid u --user-data-file /nonexistent/user-data",
		"images",
		"images prune",
		"images verify",
		"images evict Bad_Key",
		"probe proxy-a",
		"probe proxy-a --target nohost",
		"gc",
		"gc --owner tooling --keep-file /nonexistent/keep",
		"help nosuch",
		"completion",
		"completion tcsh",
		"--entry lab9 ls",
	} {
		lines = append(lines, strings.Fields(line))
	}
	got := w.transcript(lines...)
	golden(t, "errors", got)
	for _, args := range lines {
		code, out, errs := w.runT(args...)
		if code != exitUsage || out != "" || !strings.HasPrefix(errs, "egressproxyctl: ") {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want 2, nothing, one message", args, code, out, errs)
		}
		if n := strings.Count(errs, "\n"); n > 2 {
			t.Errorf("%q: %d lines on stderr, want the message and at most the pointer to --help:\n%s", args, n, errs)
		}
		for _, leak := range []string{"[]", "%!", "{", "flag provided but not defined", "time: invalid duration", "strconv."} {
			if strings.Contains(errs, leak) {
				t.Errorf("%q: stderr shows Go formatting %q: %s", args, leak, errs)
			}
		}
	}
}

// Each command's output in every format: the table (with and without its
// header), JSON, YAML and names.
func TestGoldenOutput(t *testing.T) {
	w := goldenWorld(t)
	w.want(exitOK, "create", "proxy-a", "--uid", "uid-a", "--entry", "lab1", "--port", "8080")
	w.want(exitOK, "create", "proxy-b", "--uid", "uid-b", "--entry", "lab2")
	keep := filepath.Join(t.TempDir(), "keep")
	if err := os.WriteFile(keep, []byte("uid-a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, cmd := range map[string]string{
		"ls":        "ls",
		"check":     "check",
		"images-ls": "images ls --entry lab1",
		"create":    "create proxy-a --uid uid-a --entry lab1 --port 8080",
		"delete":    "delete proxy-z --uid uid-z --entry lab1",
		"gc":        "gc --owner tooling --keep-file KEEP --dry-run",
		"version":   "version",
	} {
		t.Run(name, func(t *testing.T) {
			var lines [][]string
			for _, format := range []string{"", " --no-headers", " -o json", " -o yaml", " -o name"} {
				lines = append(lines, strings.Fields(strings.ReplaceAll(cmd, "KEEP", keep)+format))
			}
			golden(t, "output/"+name, strings.ReplaceAll(w.transcript(lines...), keep, "KEEP"))
		})
	}
}

// Every command takes the global flags anywhere on the line: before the
// command, right after it and after its own arguments and flags, with the
// same output.
func TestFlagsAnywhere(t *testing.T) {
	w := goldenWorld(t)
	w.want(exitOK, "create", "proxy-a", "--uid", "uid-a", "--entry", "lab1")
	keep := filepath.Join(t.TempDir(), "keep")
	if err := os.WriteFile(keep, []byte("uid-a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	global := []string{"--entry", "lab1", "-o", "json", "--no-headers", "--timeout", "1m", "-v", "0"}
	for _, cmd := range [][]string{
		{"check"}, {"ls"}, {"list"}, {"images", "ls"}, {"images", "verify", "base"}, {"version"},
		{"create", "proxy-a", "--uid", "uid-a"},
		{"delete", "proxy-z", "--uid", "uid-z"},
		{"gc", "--owner", "tooling", "--keep-file", keep, "--dry-run"},
	} {
		t.Run(strings.Join(cmd[:min(2, len(cmd))], "-"), func(t *testing.T) {
			var first string
			verb := 1
			if cmd[0] == "images" {
				verb = 2
			}
			for i, args := range [][]string{
				append(append([]string{}, global...), cmd...),
				append(append(append([]string{}, cmd[:verb]...), global...), cmd[verb:]...),
				append(append([]string{}, cmd...), global...),
			} {
				code, out, errs := w.runT(args...)
				if code != exitOK {
					t.Fatalf("%q: exit %d, stderr %q", args, code, errs)
				}
				if !strings.HasPrefix(out, "{") {
					t.Errorf("%q: -o json not applied: %q", args, out)
				}
				if i == 0 {
					first = out
				} else if out != first {
					t.Errorf("%q prints\n%s\nthe flags before the command print\n%s", args, out, first)
				}
			}
			if got := w.opened; cmd[0] != "version" && (len(got) != 1 || got[0] != "lab1") {
				t.Errorf("--entry lab1 after the command opened %v", got)
			}
		})
	}
}
