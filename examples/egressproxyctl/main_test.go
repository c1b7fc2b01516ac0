package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
	"github.com/egressproxy/egressproxy/kvm2"
	"github.com/egressproxy/egressproxy/memprovider"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// syncBuffer is a bytes.Buffer safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// world is the test's backends: one memprovider per config entry, kept
// across runs of the command (the clients' Close does not close them).
type world struct {
	t      *testing.T
	mu     sync.Mutex
	mems   map[string]*egressproxy.Client
	images map[string]*fakeImages // entries whose provider implements ImageManager
	opts   memprovider.Options
	config string // path of the config file
	tty    bool
	opened []string // entries opened, per run
	// now and buildInfo, when set, are the program's clock and build
	// information (env.now, env.buildInfo).
	now       func() time.Time
	buildInfo func() (*debug.BuildInfo, bool)
}

func newWorld(t *testing.T, entries ...string) *world {
	t.Helper()
	w := &world{t: t, mems: map[string]*egressproxy.Client{}, images: map[string]*fakeImages{}, opts: memprovider.Options{ServeProxies: true}}
	var b strings.Builder
	b.WriteString("entries:\n")
	for _, e := range entries {
		owner := "tooling"
		if strings.HasPrefix(e, "other") {
			owner = "someone-else"
		}
		// camelCase keys, as an embedder writes them (no duration fields).
		fmt.Fprintf(&b, "  - entry: %s\n    owner: %s\n    address: 127.0.0.1:22\n    user: root\n    keyFile: /nonexistent/key\n    knownHostsFile: /nonexistent/known_hosts\n    pool: default\n    defaultImage: base\n    domainType: qemu\n"+
			"    images:\n      base: {url: http://127.0.0.1:1/base.qcow2}\n      other: {url: http://127.0.0.1:1/other.qcow2}\n", e, owner)
	}
	w.config = filepath.Join(t.TempDir(), "ctl.yaml")
	if err := os.WriteFile(w.config, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return w
}

func (w *world) mem(entry string) *egressproxy.Client {
	w.mu.Lock()
	defer w.mu.Unlock()
	p, ok := w.mems[entry]
	if !ok {
		p = memprovider.New(&w.opts)
		w.mems[entry] = p
		w.t.Cleanup(func() { p.Close() })
	}
	return p
}

// bare hides every optional interface of the provider it wraps, and its
// Close, so a memprovider lives across runs.
type bare struct{ driver.Provider }

func (bare) Close() error { return nil }

// managed is bare plus a fake ImageManager.
type managed struct {
	bare
	*fakeImages
}

func (w *world) open(ctx context.Context, cfgs []kvm2.Config, opts kvm2.Options) ([]*egressproxy.Client, error) {
	co := &egressproxy.Options{Logger: opts.Logger}
	var out []*egressproxy.Client
	w.mu.Lock()
	w.opened = nil
	w.mu.Unlock()
	for _, c := range cfgs {
		p := bare{w.mem(c.Entry)}
		w.mu.Lock()
		w.opened = append(w.opened, c.Entry)
		fi := w.images[c.Entry]
		w.mu.Unlock()
		if fi != nil {
			fi.p = p
			out = append(out, driver.NewClient(managed{p, fi}, co))
			continue
		}
		out = append(out, driver.NewClient(p, co))
	}
	return out, nil
}

// fakeImages is an ImageManager over a fixed set of keys; a key is in use
// by the instances whose spec names it (or that name none, for "base").
type fakeImages struct {
	p       driver.Provider
	mu      sync.Mutex
	present map[string]bool
	corrupt map[string]bool
}

func (f *fakeImages) users(ctx context.Context, key string) []string {
	insts, _ := f.p.List(ctx)
	var out []string
	for _, i := range insts {
		out = append(out, i.Name)
	}
	sort.Strings(out)
	if key != "base" {
		return nil
	}
	return out
}

func (f *fakeImages) info(ctx context.Context, key string) egressproxy.ImageInfo {
	info := egressproxy.ImageInfo{Key: key, Present: f.present[key], InUseBy: f.users(ctx, key)}
	if info.Present {
		info.Name, info.Digest, info.SizeBytes = "base-"+key+".qcow2", strings.Repeat("ab", 32), 3<<20
	}
	return info
}

func (f *fakeImages) ListImages(ctx context.Context) ([]egressproxy.ImageInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []egressproxy.ImageInfo
	for _, k := range []string{"base", "other"} {
		out = append(out, f.info(ctx, k))
	}
	return out, nil
}

func (f *fakeImages) VerifyImage(ctx context.Context, key string) (egressproxy.ImageInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case key != "base" && key != "other":
		return egressproxy.ImageInfo{}, errs.Errorf(egressproxy.Permanent, "unknown image key %q", key)
	case !f.present[key]:
		return egressproxy.ImageInfo{}, errs.Errorf(egressproxy.NotFound, "image %q has no base", key)
	case f.corrupt[key]:
		return egressproxy.ImageInfo{}, errs.Errorf(egressproxy.Permanent, "image %q: stored bytes differ from the recorded digest", key)
	}
	info := f.info(ctx, key)
	info.Verified = true
	return info, nil
}

func (f *fakeImages) EvictImage(ctx context.Context, key string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.users(ctx, key); len(u) > 0 {
		return errs.Errorf(egressproxy.Permanent, "image %q in use by %v", key, u)
	}
	delete(f.present, key)
	return nil
}

// runT runs the program with args after "--config FILE".
func (w *world) runT(args ...string) (code int, stdout, stderr string) {
	return w.runCtx(context.Background(), args...)
}

func (w *world) runCtx(ctx context.Context, args ...string) (code int, stdout, stderr string) {
	w.t.Helper()
	var out, errb syncBuffer
	code = run(ctx, append([]string{"--config", w.config}, args...), w.env(&out, &errb))
	w.t.Logf("egressproxyctl %s → %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, out.String(), errb.String())
	return code, out.String(), errb.String()
}

// env is the program's environment in this world, writing to out and
// errb.
func (w *world) env(out, errb io.Writer) *env {
	return &env{stdout: out, stderr: errb, tty: w.tty, open: w.open, getenv: func(string) string { return "" },
		pollEvery: 5 * time.Millisecond, now: w.now, buildInfo: w.buildInfo}
}

func (w *world) want(wantCode int, args ...string) (stdout, stderr string) {
	w.t.Helper()
	code, stdout, stderr := w.runT(args...)
	if code != wantCode {
		w.t.Fatalf("egressproxyctl %s: exit %d, want %d\nstderr: %s", strings.Join(args, " "), code, wantCode, stderr)
	}
	return stdout, stderr
}

func TestUsage(t *testing.T) {
	w := newWorld(t, "lab1", "lab2")
	for _, tc := range []struct {
		args []string
		want string // in stderr
	}{
		{[]string{"frobnicate"}, "unknown command"},
		{[]string{"-o", "xml", "ls"}, "want table, json, yaml or name"},
		{[]string{"--entry", "lab9", "ls"}, "has no such entry"},
		{[]string{"create", "proxy-a"}, "invalid --uid"},
		{[]string{"create", "Proxy_A", "--uid", "u"}, "invalid NAME"},
		{[]string{"create", "proxy-a", "--uid", "u"}, "choose one with --entry"},
		{[]string{"create", "proxy-a", "--uid", "u", "--user-data-file", "/nonexistent"}, "--user-data-file"},
		{[]string{"delete"}, "delete needs one instance NAME"},
		{[]string{"probe", "proxy-a"}, "--target"},
		{[]string{"images"}, "needs a subcommand"},
		{[]string{"images", "verify"}, "needs one image KEY"},
		{[]string{"images", "prune"}, "unknown subcommand"},
		{[]string{"gc", "--owner", "tooling"}, "gc needs --keep-file"},
		{[]string{"ls", "--bogus"}, "unknown flag --bogus"},
	} {
		code, _, stderr := w.runT(tc.args...)
		if code != exitUsage || !strings.Contains(stderr, tc.want) {
			t.Errorf("%q: exit %d, stderr %q; want %d and %q", tc.args, code, stderr, exitUsage, tc.want)
		}
	}

	// No config at all.
	var out, errb syncBuffer
	if code := run(context.Background(), []string{"ls"}, &env{stdout: &out, stderr: &errb, open: w.open, getenv: func(string) string { return "" }}); code != exitUsage || !strings.Contains(errb.String(), "EGRESSPROXYCTL_CONFIG") {
		t.Errorf("no config: exit %d, stderr %q", code, errb.String())
	}
	// The config from the environment.
	errb = syncBuffer{}
	if code := run(context.Background(), []string{"ls"}, &env{stdout: &out, stderr: &errb, open: w.open, getenv: func(k string) string {
		return map[string]string{"EGRESSPROXYCTL_CONFIG": w.config}[k]
	}}); code != exitOK {
		t.Errorf("config from $EGRESSPROXYCTL_CONFIG: exit %d, stderr %q", code, errb.String())
	}

	// -h documents the exit codes and the commands on stdout, and exits 0.
	stdout, stderr := w.want(exitOK, "-h")
	for _, s := range []string{"Exit codes", "130", "Transient", "images", "gc", "-o, --output"} {
		if !strings.Contains(stdout, s) {
			t.Errorf("-h does not mention %q", s)
		}
	}
	if stderr != "" {
		t.Errorf("-h wrote to stderr: %q", stderr)
	}
	if out, _ := w.want(exitOK, "create", "-h"); !strings.Contains(out, "--user-data-file") {
		t.Errorf("create -h: %q", out)
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	w := newWorld(t, "lab1")
	const ok = "    owner: tooling\n    address: 127.0.0.1:22\n    user: root\n    keyFile: /k\n    knownHostsFile: /kh\n    pool: default\n"
	for name, tt := range map[string]struct {
		body string
		want []string
	}{
		"unknown field": {"entries:\n  - entry: lab1\n" + ok + "    adress: x\n", []string{"line 9: invalid entries[0].adress: unknown key; did you mean address?"}},
		"no entries":    {"entries: []\n", []string{"line 1: invalid entries: must list at least one entry"}},
		"bad entry":     {"entries:\n  - entry: Lab_1\n" + ok, []string{`line 2: invalid entries[0].entry "Lab_1"`}},
		"twice":         {"entries:\n  - entry: lab1\n" + ok + "  - entry: lab1\n" + ok, []string{`line 9: invalid entries[1].entry "lab1": is also the name of entries[0]`}},
		"not yaml":      {"entries: [\n", []string{"yaml: line 1: "}},
		// Every problem of every entry at once, with its entry's index.
		"several": {"entries:\n  - entry: lab1\n" + ok + "    callTimeout: 30\n  - entry: lab2\n" + strings.Replace(ok, "127.0.0.1:22", "127.0.0.1", 1) +
			"    images:\n      deb: {url: http://h/d.qcow2, sha256: abc}\n", []string{
			"3 problems:\n",
			"\n  line 9: invalid entries[0].callTimeout \"30\": must be a duration",
			"\n  line 12: invalid entries[1].address \"127.0.0.1\": must be host:port",
			"\n  line 18: invalid entries[1].images.deb.sha256 \"abc\": must be 64 lowercase hex digits",
		}},
	} {
		p := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		if err := os.WriteFile(p, []byte(tt.body), 0o600); err != nil {
			t.Fatal(err)
		}
		w.config = p
		code, _, stderr := w.runT("ls")
		if code != exitUsage || !strings.Contains(stderr, p+": ") {
			t.Errorf("%s: exit %d, stderr %q; want %d naming the file", name, code, stderr, exitUsage)
		}
		for _, want := range tt.want {
			if !strings.Contains(stderr, want) {
				t.Errorf("%s: stderr lacks %q:\n%s", name, want, stderr)
			}
		}
	}
	// JSON works as well as YAML; keys match kvm2.Config's fields.
	p := filepath.Join(dir, "ctl.json")
	if err := os.WriteFile(p, []byte(`{"entries": [{"entry": "lab1", "owner": "tooling", "address": "127.0.0.1:22", "user": "root", "keyFile": "/k", "knownHostsFile": "/kh", "pool": "default", "libvirtSocket": "/run/x.sock", "images": {"base": {"url": "http://127.0.0.1/x.qcow2"}}}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	if c := cfg.Entries[0]; c.LibvirtSocket != "/run/x.sock" || c.Images["base"].URL != "http://127.0.0.1/x.qcow2" || c.Owner != "tooling" {
		t.Errorf("parsed %+v", c)
	}
}

// A FieldError from opening an entry (a bad kvm2 config) is a usage error
// naming the file.
func TestOpenFieldErrorIsUsage(t *testing.T) {
	w := newWorld(t, "lab1")
	var out, errb syncBuffer
	e := &env{stdout: &out, stderr: &errb, getenv: func(string) string { return "" },
		open: func(ctx context.Context, cfgs []kvm2.Config, _ kvm2.Options) ([]*egressproxy.Client, error) {
			return nil, errs.WithCode(egressproxy.Permanent, &egressproxy.FieldError{Field: "Pool", Rule: "is required"})
		}}
	if code := run(context.Background(), []string{"--config", w.config, "check"}, e); code != exitUsage || !strings.Contains(errb.String(), "invalid Pool") {
		t.Errorf("exit %d, stderr %q", code, errb.String())
	}
}

func decode[T any](t *testing.T, s string) T {
	t.Helper()
	var v T
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("stdout is not the JSON document expected: %v\n%s", err, s)
	}
	if dec.More() {
		t.Fatalf("stdout holds more than one JSON document:\n%s", s)
	}
	return v
}

type lsJSON struct {
	Instances []instanceRow `json:"instances"`
}

func TestCreateLsDelete(t *testing.T) {
	w := newWorld(t, "lab1", "lab2")
	ud := filepath.Join(t.TempDir(), "user-data")
	if err := os.WriteFile(ud, []byte("#cloud-config\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, _ := w.want(exitOK, "--entry", "lab1", "create", "proxy-a", "--uid", "uid-a", "--port", "8080", "--user-data-file", ud, "--image", "base", "--machine-type", "small")
	if !regexp.MustCompile(`(?m)^lab1\s+proxy-a\s+Running\s+127\.0\.0\.1:\d+\s+uid-a\s`).MatchString(out) {
		t.Errorf("create table:\n%s", out)
	}
	if got := w.opened; len(got) != 1 || got[0] != "lab1" {
		t.Errorf("-entry lab1 opened %v, want only lab1", got)
	}
	// Idempotent on the UID.
	w.want(exitOK, "--entry", "lab1", "create", "proxy-a", "--uid", "uid-a", "--port", "8080", "--user-data-file", ud, "--image", "base", "--machine-type", "small")
	// Another spec for that UID: Permanent.
	w.want(exitPermanent, "--entry", "lab1", "create", "proxy-a", "--uid", "uid-a")
	w.want(exitOK, "--entry", "lab2", "-o", "json", "create", "proxy-b", "--uid", "uid-b")

	out, _ = w.want(exitOK, "ls")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "ENTRY") || !strings.Contains(lines[1], "proxy-a") || !strings.Contains(lines[2], "proxy-b") {
		t.Errorf("ls table:\n%s", out)
	}
	out, _ = w.want(exitOK, "-o", "json", "ls")
	ls := decode[lsJSON](t, out)
	if len(ls.Instances) != 2 || ls.Instances[0].Entry != "lab1" || ls.Instances[0].UID != "uid-a" || ls.Instances[0].State != "Running" ||
		!strings.HasPrefix(ls.Instances[0].Address, "127.0.0.1:") || ls.Instances[0].SpecDigest == "" || ls.Instances[1].Name != "proxy-b" {
		t.Errorf("ls json: %+v", ls)
	}

	// delete finds the entry and UID by name.
	out, _ = w.want(exitOK, "delete", "proxy-a")
	if !strings.Contains(out, "deleted proxy-a (uid uid-a) on lab1") {
		t.Errorf("delete: %q", out)
	}
	w.want(exitNotFound, "delete", "proxy-a")
	// With -uid a missing instance is fine (Delete is idempotent).
	w.want(exitOK, "--entry", "lab1", "delete", "proxy-a", "--uid", "uid-a")
	out, _ = w.want(exitOK, "-o", "json", "delete", "proxy-b")
	if d := decode[map[string][]map[string]string](t, out); len(d["deleted"]) != 1 || d["deleted"][0]["uid"] != "uid-b" {
		t.Errorf("delete json: %s", out)
	}
	out, _ = w.want(exitOK, "-o", "json", "ls")
	if ls := decode[lsJSON](t, out); ls.Instances == nil || len(ls.Instances) != 0 {
		t.Errorf("ls json after delete: %s (want an empty list, not null)", out)
	}
}

func TestNameOnSeveralEntries(t *testing.T) {
	w := newWorld(t, "lab1", "lab2")
	w.want(exitOK, "--entry", "lab1", "create", "proxy-a", "--uid", "uid-1")
	w.want(exitOK, "--entry", "lab2", "create", "proxy-a", "--uid", "uid-2")
	if _, stderr := w.want(exitUsage, "delete", "proxy-a"); !strings.Contains(stderr, "lab1/proxy-a, lab2/proxy-a") {
		t.Errorf("stderr %q", stderr)
	}
	// ENTRY/NAME, as -o name prints it, picks the entry.
	if out, _ := w.want(exitOK, "ls", "-o", "name"); out != "lab1/proxy-a\nlab2/proxy-a\n" {
		t.Errorf("ls -o name: %q", out)
	}
	w.want(exitOK, "delete", "lab2/proxy-a")
	out, _ := w.want(exitOK, "-o", "json", "ls")
	if ls := decode[lsJSON](t, out); len(ls.Instances) != 1 || ls.Instances[0].UID != "uid-1" {
		t.Errorf("ls: %+v", ls)
	}
}

type checkJSON struct {
	Entries []checkRow `json:"entries"`
}

func TestCheckAndExitCodes(t *testing.T) {
	w := newWorld(t, "lab1", "lab2")
	out, _ := w.want(exitOK, "check")
	// The capacity is in the table: pool free, memory, CPUs, proxies.
	if !regexp.MustCompile(`(?m)^lab1\s+yes\s+-\s+100\.00 GiB\s+16\.00 GiB\s+8\s+0\s`).MatchString(out) || !regexp.MustCompile(`(?m)^lab2\s+yes\s`).MatchString(out) {
		t.Errorf("check table:\n%s", out)
	}

	w.ctl("lab2").InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Permanent, Reason: egressproxy.ReasonUnauthorized, Err: errors.New("ssh: unable to authenticate")})
	out, stderr := w.want(exitPermanent, "check")
	// The failure is said once: the table names the reason, stderr says
	// what happened.
	if !regexp.MustCompile(`(?m)^lab2\s+no\s+Unauthorized(\s+-){5}$`).MatchString(out) || !strings.Contains(stderr, "entry lab2") ||
		strings.Count(out+stderr, "unable to authenticate") != 1 {
		t.Errorf("check with lab2 unauthorized:\n%s\n%s", out, stderr)
	}
	out, _ = w.want(exitPermanent, "-o", "json", "check")
	c := decode[checkJSON](t, out)
	if len(c.Entries) != 2 || !c.Entries[0].Reachable || c.Entries[1].Reachable || c.Entries[1].Reason != "Unauthorized" {
		t.Errorf("check json: %+v", c)
	}
	// The entry facts: the reachable entry's capacity, none for the other.
	if len(c.Entries) == 2 {
		want := capacityRow{PoolAvailableBytes: 100 << 30, MemoryAvailableBytes: 16 << 30, CPUs: 8}
		if cp := c.Entries[0].Capacity; cp == nil || *cp != want {
			t.Errorf("check json: lab1's capacity %+v, want %+v", cp, want)
		}
		if cp := c.Entries[1].Capacity; cp != nil {
			t.Errorf("check json: unreachable lab2's capacity %+v, want none", cp)
		}
	}
	w.ctl("lab2").ClearFaults()
	w.ctl("lab2").InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient, Reason: egressproxy.ReasonUnreachable})
	w.want(exitTransient, "check")
	w.ctl("lab2").ClearFaults()

	// ls: the class of a failing entry is the exit code; the other entry is
	// still listed; the most severe class wins.
	w.want(exitOK, "--entry", "lab1", "create", "proxy-a", "--uid", "uid-a")
	for _, tc := range []struct {
		lab1, lab2 egressproxy.ErrorCode
		want       int
	}{
		{egressproxy.OK, egressproxy.Transient, exitTransient},
		{egressproxy.OK, egressproxy.Permanent, exitPermanent},
		{egressproxy.Transient, egressproxy.Permanent, exitPermanent},
		{egressproxy.NotFound, egressproxy.Transient, exitTransient},
		// egressproxy.Client classes an unclassed backend error Transient.
		{egressproxy.OK, egressproxy.Unknown, exitTransient},
	} {
		for entry, code := range map[string]egressproxy.ErrorCode{"lab1": tc.lab1, "lab2": tc.lab2} {
			w.ctl(entry).ClearFaults()
			switch code {
			case egressproxy.OK:
			case egressproxy.Unknown:
				w.ctl(entry).InjectFault(memprovider.OpList, memprovider.Fault{Err: errors.New("unclassed")})
			default:
				w.ctl(entry).InjectFault(memprovider.OpList, memprovider.Fault{Code: code})
			}
		}
		code, out, _ := w.runT("ls")
		if code != tc.want {
			t.Errorf("ls with faults lab1=%v lab2=%v: exit %d, want %d", tc.lab1, tc.lab2, code, tc.want)
		}
		if tc.lab1 == egressproxy.OK && !strings.Contains(out, "proxy-a") {
			t.Errorf("ls with a failing lab2 does not list lab1's proxy:\n%s", out)
		}
	}
	w.ctl("lab1").ClearFaults()
	w.ctl("lab2").ClearFaults()

	// A read-back failing in ls keeps the row and says why.
	w.ctl("lab1").InjectFault(memprovider.OpGet, memprovider.Fault{Code: egressproxy.Transient, Err: errors.New("every address source failed")})
	out, stderr = w.want(exitTransient, "--entry", "lab1", "ls")
	if !regexp.MustCompile(`(?m)^lab1\s+proxy-a\s+Running\s+\?\s`).MatchString(out) || strings.Count(out+stderr, "every address source failed") != 1 ||
		!strings.Contains(stderr, "every address source failed") {
		t.Errorf("ls with failing Get:\n%s\n%s", out, stderr)
	}
}

func TestProbe(t *testing.T) {
	const body = "ctl target ok"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, body) }))
	defer srv.Close()
	target := strings.TrimPrefix(srv.URL, "http://")

	w := newWorld(t, "lab1", "lab2")
	pwFile := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(pwFile, []byte("pr0be-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The proxy's guest description asks for the probe's credentials
	// (memprovider serves what the user-data describes).
	_, port, _ := net.SplitHostPort(target)
	portN, _ := strconv.Atoi(port)
	ud, err := guest.UserData(guest.Config{Users: []guest.User{{Name: "probe", Password: "pr0be-secret"}},
		AllowedDestinations: []guest.Destination{{Ports: []int{portN}}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	udFile := filepath.Join(t.TempDir(), "user-data")
	if err := os.WriteFile(udFile, []byte(ud), 0o600); err != nil {
		t.Fatal(err)
	}
	w.want(exitOK, "--entry", "lab2", "create", "proxy-a", "--uid", "uid-a", "--user-data-file", udFile)

	out, _ := w.want(exitOK, "probe", "proxy-a", "--target", target, "--proxy-user", "probe", "--proxy-password-file", pwFile, "--expect-body", body)
	if !regexp.MustCompile(`(?m)^lab2\s+proxy-a\s+127\.0\.0\.1:\d+\s+` + regexp.QuoteMeta(target) + `\s+ok\s+200\s`).MatchString(out) {
		t.Errorf("probe table:\n%s", out)
	}
	out, _ = w.want(exitOK, "-o", "json", "probe", "--target", target, "--proxy-user", "probe", "--proxy-password-file", pwFile, "proxy-a")
	if r := decode[probeRow](t, out); !r.OK || r.StatusCode != 200 || r.Entry != "lab2" || r.Target != target {
		t.Errorf("probe json: %+v", r)
	}
	// The wrong body fails the tunnel proof: Transient.
	w.want(exitTransient, "probe", "proxy-a", "--target", target, "--proxy-user", "probe", "--proxy-password-file", pwFile, "--expect-body", "something else")
	// No credentials: the proxy answers 407: Permanent.
	out, stderr := w.want(exitPermanent, "probe", "proxy-a", "--target", target)
	if !strings.Contains(out, "auth-required") {
		t.Errorf("probe without credentials:\n%s", out)
	}
	if strings.Contains(out+stderr, "pr0be-secret") {
		t.Errorf("the password is printed")
	}
	w.want(exitNotFound, "probe", "proxy-z", "--target", target)

	// A proxy still provisioning has no address: Transient.
	now := time.Now()
	w2 := newWorld(t, "lab1")
	w2.opts.Now = func() time.Time { return now }
	w2.opts.ProvisionDelay = time.Hour
	w2.want(exitOK, "create", "proxy-p", "--uid", "uid-p")
	if _, stderr := w2.want(exitTransient, "probe", "proxy-p", "--target", target); !strings.Contains(stderr, "no address") {
		t.Errorf("probe of a provisioning proxy: %q", stderr)
	}
}

func TestCreateWaitAndProgress(t *testing.T) {
	now := time.Now()
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	w := newWorld(t, "lab1")
	w.opts.Now = clock
	w.opts.ProvisionDelay = time.Minute
	w.tty = true
	w.images["lab1"] = &fakeImages{present: map[string]bool{}}

	// -wait gives up after its bound: Transient.
	_, stderr := w.want(exitTransient, "create", "proxy-a", "--uid", "uid-a", "--wait", "50ms")
	if !strings.Contains(stderr, "entry lab1: --wait 50ms passed: ") || !strings.Contains(stderr, "(state Provisioning)") {
		t.Errorf("stderr %q", stderr)
	}
	// The cold image is announced, and progress is drawn on the terminal.
	if !strings.Contains(stderr, "image base is not cached") || !strings.Contains(stderr, "fetching image base into lab1") {
		t.Errorf("no cold-fetch notice in %q", stderr)
	}
	mu.Lock()
	now = now.Add(2 * time.Minute)
	mu.Unlock()
	w.images["lab1"].present["base"] = true
	out, stderr := w.want(exitOK, "create", "proxy-a", "--uid", "uid-a", "--wait", "1m")
	if !strings.Contains(out, "Running") || strings.Contains(stderr, "fetching image") || !strings.Contains(stderr, "creating proxy-a on lab1…") {
		t.Errorf("warm create -wait:\n%s\n%q", out, stderr)
	}
	// Not on a terminal: no progress line.
	w.tty = false
	if _, stderr := w.want(exitOK, "create", "proxy-a", "--uid", "uid-a"); stderr != "" {
		t.Errorf("progress without a terminal: %q", stderr)
	}
	// A stopped instance ends the wait at once: Permanent.
	if err := w.ctl("lab1").SetState(egressproxy.Ref{Name: "proxy-a", UID: "uid-a"}, egressproxy.StateStopped); err != nil {
		t.Fatal(err)
	}
	w.want(exitPermanent, "create", "proxy-a", "--uid", "uid-a", "--wait", "1m")
}

type imagesJSON struct {
	Images []imageRow `json:"images"`
}

func TestImages(t *testing.T) {
	w := newWorld(t, "lab1", "lab2")
	w.images["lab1"] = &fakeImages{present: map[string]bool{"base": true}, corrupt: map[string]bool{}}

	// lab2's provider has no ImageManager: said plainly, Permanent.
	out, stderr := w.want(exitPermanent, "images", "ls")
	if !regexp.MustCompile(`(?m)^lab1\s+base\s+yes\s+base-base\.qcow2\s+abababababab\s+3\.0 MiB`).MatchString(out) ||
		!regexp.MustCompile(`(?m)^lab1\s+other\s+no\s`).MatchString(out) ||
		strings.Contains(out, "lab2") || !strings.Contains(stderr, "entry lab2: egressproxy list-images: not supported by this provider") {
		t.Errorf("images ls:\n%s\n%s", out, stderr)
	}
	out, _ = w.want(exitOK, "--entry", "lab1", "-o", "json", "images", "ls")
	if im := decode[imagesJSON](t, out); len(im.Images) != 2 || im.Images[0].Key != "base" || !im.Images[0].Present || im.Images[0].SizeBytes != 3<<20 {
		t.Errorf("images ls json: %+v", im)
	}

	w.want(exitOK, "--entry", "lab1", "create", "proxy-a", "--uid", "uid-a")
	out, _ = w.want(exitOK, "--entry", "lab1", "images", "verify", "base")
	if !regexp.MustCompile(`(?m)^lab1\s+base\s+verified\s.*proxy-a`).MatchString(out) {
		t.Errorf("verify:\n%s", out)
	}
	w.want(exitNotFound, "--entry", "lab1", "images", "verify", "other")
	w.want(exitPermanent, "--entry", "lab1", "images", "verify", "nope")
	w.images["lab1"].corrupt["base"] = true
	w.want(exitPermanent, "--entry", "lab1", "images", "verify", "base")

	// Evict refuses while in use, then works.
	if _, stderr := w.want(exitPermanent, "--entry", "lab1", "images", "evict", "base"); !strings.Contains(stderr, "in use") {
		t.Errorf("evict in use: %q", stderr)
	}
	w.want(exitOK, "delete", "proxy-a")
	out, _ = w.want(exitOK, "--entry", "lab1", "images", "evict", "base")
	if !strings.Contains(out, "evicted") {
		t.Errorf("evict:\n%s", out)
	}
	out, _ = w.want(exitOK, "--entry", "lab1", "-o", "json", "images", "ls")
	if im := decode[imagesJSON](t, out); im.Images[0].Present {
		t.Errorf("after evict: %+v", im)
	}
}

type gcJSON struct {
	DryRun    bool    `json:"dryRun"`
	Instances []gcRow `json:"instances"`
	Kept      int     `json:"kept"`
}

func TestGC(t *testing.T) {
	w := newWorld(t, "lab1", "other1")
	for _, n := range []string{"a", "b", "c"} {
		w.want(exitOK, "--entry", "lab1", "create", "proxy-"+n, "--uid", "uid-"+n)
	}
	w.want(exitOK, "--entry", "other1", "create", "proxy-x", "--uid", "uid-x")
	dir := t.TempDir()
	keep := filepath.Join(dir, "keep")
	if err := os.WriteFile(keep, []byte("# the UIDs the controller still wants\nuid-a\n\n  uid-x  \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, stderr := w.want(exitOK, "gc", "--owner", "tooling", "--keep-file", keep, "--dry-run")
	if !regexp.MustCompile(`(?m)^lab1\s+proxy-b\s+uid-b\s+would delete`).MatchString(out) || !regexp.MustCompile(`(?m)^lab1\s+proxy-c\s+uid-c\s+would delete`).MatchString(out) ||
		strings.Contains(out, "proxy-a") || strings.Contains(out, "proxy-x") || !strings.Contains(stderr, "skipping entry other1") || !strings.Contains(stderr, "1 kept, 2 would be deleted") {
		t.Errorf("gc -dry-run:\n%s\n%s", out, stderr)
	}
	out, _ = w.want(exitOK, "-o", "json", "ls")
	if ls := decode[lsJSON](t, out); len(ls.Instances) != 4 {
		t.Fatalf("dry run deleted something: %+v", ls)
	}
	out, _ = w.want(exitOK, "-o", "json", "gc", "--owner", "tooling", "--keep-file", keep)
	g := decode[gcJSON](t, out)
	if g.DryRun || g.Kept != 1 || len(g.Instances) != 2 || g.Instances[0].Action != "deleted" || g.Instances[1].UID != "uid-c" {
		t.Errorf("gc json: %+v", g)
	}
	out, _ = w.want(exitOK, "-o", "json", "ls")
	var names []string
	for _, i := range decode[lsJSON](t, out).Instances {
		names = append(names, i.Name)
	}
	if strings.Join(names, ",") != "proxy-a,proxy-x" {
		t.Errorf("after gc: %v, want proxy-a (kept) and proxy-x (another owner)", names)
	}

	// A failing delete is reported with its class.
	w.ctl("lab1").InjectFault(memprovider.OpDelete, memprovider.Fault{Code: egressproxy.Transient})
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("# nothing\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, stderr := w.want(exitUsage, "gc", "--owner", "tooling", "--keep-file", empty); !strings.Contains(stderr, "--allow-empty") {
		t.Errorf("empty keep file: %q", stderr)
	}
	out, stderr = w.want(exitTransient, "gc", "--owner", "tooling", "--keep-file", empty, "--allow-empty")
	if !regexp.MustCompile(`(?m)^lab1\s+proxy-a\s+uid-a\s+failed\s`).MatchString(out) || !strings.Contains(stderr, "0 kept, 0 deleted, 1 failed") {
		t.Errorf("gc with failing delete:\n%s", out)
	}
	w.want(exitUsage, "gc", "--owner", "nobody", "--keep-file", keep)
	w.want(exitUsage, "gc", "--owner", "tooling", "--keep-file", filepath.Join(dir, "missing"))
}

// Cancelling the context (what Ctrl-C does) ends a call in flight
// promptly with exit code 130; goleak (TestMain) checks that nothing is
// left running.
func TestCanceled(t *testing.T) {
	w := newWorld(t, "lab1")
	w.opts.ProvisionDelay = time.Hour // never Running: create -wait polls Get
	w.tty = true                      // the progress goroutine must end too
	for _, tc := range []struct {
		op   memprovider.Op
		args []string
	}{
		{memprovider.OpCreate, []string{"create", "proxy-a", "--uid", "uid-a"}},
		{memprovider.OpList, []string{"ls"}},
		{memprovider.OpCheck, []string{"check"}},
		{memprovider.OpGet, []string{"create", "proxy-b", "--uid", "uid-b", "--wait", "1h"}},
	} {
		ctx, cancel := context.WithCancel(context.Background())
		w.ctl("lab1").ClearFaults()
		w.ctl("lab1").InjectFault(tc.op, memprovider.Fault{Delay: time.Hour, Waiting: cancel})
		start := time.Now()
		code, _, stderr := w.runCtx(ctx, tc.args...)
		cancel()
		if code != exitCanceled || !strings.Contains(stderr, "canceled") {
			t.Errorf("%v canceled: exit %d, stderr %q; want %d", tc.args, code, stderr, exitCanceled)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("%v: took %s after cancel", tc.args, d)
		}
	}
}

// -timeout ends the command as Transient (a retry may succeed).
func TestTimeout(t *testing.T) {
	w := newWorld(t, "lab1")
	w.ctl("lab1").InjectFault(memprovider.OpList, memprovider.Fault{Delay: time.Hour})
	w.want(exitTransient, "--timeout", "20ms", "ls")
}

func TestExitCode(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int
	}{
		{nil, 0},
		{usagef("x"), exitUsage},
		{fmt.Errorf("entry x: %w", egressproxy.ErrTransient), exitTransient},
		{errs.Errorf(egressproxy.Permanent, "x"), exitPermanent},
		{egressproxy.ErrNotSupported, exitPermanent},
		{errs.Errorf(egressproxy.NotFound, "x"), exitNotFound},
		{context.Canceled, exitCanceled},
		{context.DeadlineExceeded, exitTransient},
		{errors.New("x"), exitFailure},
		{worst([]error{egressproxy.ErrNotFound, nil, egressproxy.ErrPermanent, egressproxy.ErrTransient}), exitPermanent},
		{worst([]error{egressproxy.ErrTransient, context.Canceled}), exitCanceled},
	} {
		if got := exitCode(tc.err); got != tc.want {
			t.Errorf("exitCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

// -v N shows the library's log lines on stderr (never on stdout); without
// it nothing is logged.
func TestVerbose(t *testing.T) {
	w := newWorld(t, "lab1")
	if _, stderr := w.want(exitOK, "ls"); stderr != "" {
		t.Errorf("ls without -v wrote %q", stderr)
	}
	out, stderr := w.want(exitOK, "-v", "2", "-o", "json", "ls")
	if !strings.Contains(stderr, `"msg"="operation done"`) || !strings.Contains(stderr, `"op"="list"`) || strings.Contains(out, "operation") {
		t.Errorf("-v 2: stdout %q, stderr %q", out, stderr)
	}
}

// fetching is a provider whose Create reports image-fetch progress through
// the callback the CLI gave the opener, and returns once the terminal's
// progress line shows it.
type fetching struct {
	bare
	progress func(imagecache.Progress)
	stderr   *syncBuffer
}

func (f fetching) Create(ctx context.Context, spec egressproxy.Spec) (egressproxy.Instance, error) {
	f.progress(imagecache.Progress{Volume: "base-lab1--base.qcow2", Bytes: 300 << 20, Total: 600 << 20, Rate: 50e6})
	if !eventually.Poll(ctx, 10*time.Second, func() bool {
		return strings.Contains(f.stderr.String(), "300.0 MiB of 600.0 MiB uploaded (50%), 50.0 MB/s")
	}) {
		return egressproxy.Instance{}, errs.Errorf(egressproxy.Transient, "progress line never showed the fetch: %q", f.stderr.String())
	}
	return f.bare.Create(ctx, spec)
}

// On a terminal, a cold fetch's byte progress (kvm2.Options.ImageProgress)
// is drawn on the progress line.
func TestCreateShowsFetchBytes(t *testing.T) {
	w := newWorld(t, "lab1")
	var out, errb syncBuffer
	e := &env{stdout: &out, stderr: &errb, tty: true, getenv: func(string) string { return "" },
		open: func(ctx context.Context, cfgs []kvm2.Config, opts kvm2.Options) ([]*egressproxy.Client, error) {
			if opts.ImageProgress == nil || opts.ImageProgressInterval <= 0 {
				t.Errorf("opener got no progress callback: %+v", opts)
			}
			return []*egressproxy.Client{driver.NewClient(fetching{bare{w.mem(cfgs[0].Entry)}, opts.ImageProgress, &errb}, nil)}, nil
		}}
	if code := run(context.Background(), []string{"--config", w.config, "create", "proxy-f", "--uid", "uid-f"}, e); code != exitOK {
		t.Fatalf("exit %d, stderr %q", code, errb.String())
	}
}

// ctl is the Control of entry's memprovider.
func (w *world) ctl(entry string) *memprovider.Control {
	var c *memprovider.Control
	if !w.mem(entry).As(&c) {
		w.t.Fatalf("no memprovider.Control for %s", entry)
	}
	return c
}

// TestCreateDescribedProxy: create's flags describe the proxy (closed by
// default, errors named by flag); the proxy serves what they say, and
// probe --egress-url prints the address the echo server saw.
func TestCreateDescribedProxy(t *testing.T) {
	echo := guesttest.ServeEcho(t, "127.0.0.1")
	target := guesttest.ServeTarget(t, "127.0.0.1")
	_, tport, _ := net.SplitHostPort(target.Addr)
	_, eport, _ := net.SplitHostPort(echo.Addr)
	pwFile := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(pwFile, []byte("cr3ate-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	w := newWorld(t, "lab1")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--allow-port", tport}, "--proxy-user: is empty and so is --allow-client"},
		{[]string{"--allow-client", "10.0.0.1/8"}, "--allow-client[0]"},
		{[]string{"--open", "--allow-client", "127.0.0.1"}, "--open"},
		{[]string{"--allow-client", "127.0.0.1", "--allow-port", "70000"}, "--allow-port[0]"},
		{[]string{"--allow-client", "127.0.0.1", "--user-data-file", pwFile}, "exclude each other"},
	} {
		_, stderr := w.want(exitUsage, append([]string{"create", "proxy-x", "--uid", "uid-x"}, tc.args...)...)
		if !strings.Contains(stderr, tc.want) {
			t.Errorf("create %q: stderr %q, want %q", tc.args, stderr, tc.want)
		}
	}
	w.want(exitOK, "create", "proxy-a", "--uid", "uid-a", "--proxy-user", "probe", "--proxy-password-file", pwFile,
		"--allow-client", "127.0.0.1", "--allow-port", tport, "--allow-port", eport)
	// Only the allowed range: a proxy for another range refuses this
	// client (403, Transient).
	w.want(exitOK, "create", "proxy-b", "--uid", "uid-b", "--allow-client", "192.0.2.0/24", "--allow-port", tport)

	out, stderr := w.want(exitOK, "probe", "proxy-a", "--target", target.Addr, "--proxy-user", "probe", "--proxy-password-file", pwFile, "--egress-url", echo.URL)
	if !regexp.MustCompile(`(?m)^EGRESS$|\sEGRESS\n`).MatchString(out) || !regexp.MustCompile(`(?m)^lab1\s+proxy-a\s.*\sok\s+200\s+\S+\s+127\.0\.0\.1$`).MatchString(out) {
		t.Errorf("probe table with --egress-url:\n%s", out)
	}
	if testing.Verbose() {
		t.Logf("probe table:\n%s", out)
	}
	if strings.Contains(out+stderr, "cr3ate-secret") {
		t.Error("the password is printed")
	}
	echo.Report("192.0.2.9")
	out, _ = w.want(exitOK, "-o", "json", "probe", "proxy-a", "--target", target.Addr, "--proxy-user", "probe", "--proxy-password-file", pwFile, "--egress-url", echo.URL)
	if r := decode[probeRow](t, out); !r.OK || r.EgressAddress != "192.0.2.9" || r.EgressError != "" {
		t.Errorf("probe json with --egress-url: %+v", r)
	}
	// The port the description does not allow: 403.
	out, _ = w.want(exitTransient, "probe", "proxy-a", "--target", "127.0.0.1:443", "--proxy-user", "probe", "--proxy-password-file", pwFile)
	if !strings.Contains(out, "proxy-status") || !strings.Contains(out, "403") {
		t.Errorf("probe to a port not allowed:\n%s", out)
	}
	out, _ = w.want(exitTransient, "probe", "proxy-b", "--target", target.Addr)
	if !strings.Contains(out, "403") {
		t.Errorf("probe from outside the allowed range:\n%s", out)
	}
}
