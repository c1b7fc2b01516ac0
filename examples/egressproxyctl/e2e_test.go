//go:build integration && e2e

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// The NAT network this test defines (transient) in the run's private
// network namespace; the CONNECT target listens on its bridge address.
// Distinct from the ./e2e test's network so the two never clash.
const (
	ctlNet       = "egp-ctl"
	ctlBridge    = "egpctl0"
	ctlGateway   = "10.78.0.1"
	ctlSubnet    = "10.78.0.0/24"
	ctlSquidPort = 8080
)

// Failure bounds on a loaded 2-core machine under TCG (docs/e2e.md), not
// performance assertions.
const (
	ctlRunningBound = 8 * time.Minute // create -wait
	ctlSquidBound   = 4 * time.Minute // after Running: Squid answers
	ctlTestBound    = 20 * time.Minute
)

var ctlUserData = guesttest.SquidUserData("egp-ctl-guest", ctlSquidPort, ctlSubnet)

const ctlHowToRun = "run `make test` (it builds the guest image, then runs the stack and the tests in a private network namespace)"

// ctlNeed skips outside CI and fails in CI (CI=true), so a misconfigured CI
// run cannot pass by skipping.
func ctlNeed(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...) + "; " + ctlHowToRun
	if teststack.InCI() {
		t.Fatalf("egressproxyctl e2e: required in CI (CI=true): %s", msg)
	}
	t.Skipf("egressproxyctl e2e: %s", msg)
}

func ctlRandHex(t *testing.T, n int) string { return guesttest.RandHex(t, n) }

// ctlRequireNetns refuses to define a network outside the private network
// namespace scripts/netns made (guesttest.Netns).
func ctlRequireNetns(t *testing.T) {
	t.Helper()
	name, _, ok, err := guesttest.Netns()
	if !ok {
		ctlNeed(t, "not inside a private network namespace (EGRESSPROXY_NETNS unset); the test defines a NAT network and boots a guest, which it only does inside one")
	}
	if err != nil {
		t.Fatalf("%v; refusing to define network %s", err, name)
	}
}

// hostObjects lists what the host holds of entry, as "domain X" and
// "volume Y", sorted.
func hostObjects(r *guesttest.Libvirt, pool, entry string) ([]string, error) {
	doms, vols, err := r.Objects(pool, entry)
	var names []string
	for d := range doms {
		names = append(names, "domain "+d)
	}
	for v := range vols {
		names = append(names, "volume "+v)
	}
	sort.Strings(names)
	return names, err
}

// ctlCLI runs the built binary.
type ctlCLI struct {
	t      *testing.T
	ctx    context.Context
	bin    string
	config string
}

func (c *ctlCLI) run(args ...string) (code int, stdout, stderr string) {
	c.t.Helper()
	cmd := exec.CommandContext(c.ctx, c.bin, append([]string{"--config", c.config}, args...)...)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	code = exitStatus(c.t, cmd.Run())
	c.t.Logf("$ egressproxyctl %s → exit %d in %s\n%s%s", strings.Join(args, " "), code, time.Since(start).Round(time.Millisecond), out.String(), errb.String())
	return code, out.String(), errb.String()
}

func (c *ctlCLI) want(code int, args ...string) string {
	c.t.Helper()
	got, out, errs := c.run(args...)
	if got != code {
		c.t.Fatalf("egressproxyctl %s: exit %d, want %d\nstderr: %s", strings.Join(args, " "), got, code, errs)
	}
	return out
}

func ctlJSON[T any](t *testing.T, s string) T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, s)
	}
	return v
}

// TestE2ECLI drives the built binary against the real stack with a config
// printed by scripts/teststack ctl-config: check → create --wait (the e2e
// guest, cold image fetch, booted under TCG) → ls → probe (a real CONNECT
// through Squid in the guest to a target on the bridge) → images ls → gc
// --dry-run → delete → gc --dry-run.
func TestE2ECLI(t *testing.T) {
	image, sum := os.Getenv("EGRESSPROXY_GUEST_IMAGE"), os.Getenv("EGRESSPROXY_GUEST_IMAGE_SHA256")
	if image == "" || sum == "" {
		ctlNeed(t, "guest image not available (EGRESSPROXY_GUEST_IMAGE unset; scripts/guestimage build, then eval \"$(scripts/guestimage env)\")")
	}
	ctlRequireNetns(t)
	env := teststack.Require(t)
	ctx, cancel := context.WithTimeout(context.Background(), ctlTestBound)
	defer cancel()

	raw := guesttest.NewLibvirt(t, env)

	// The NAT network the guest joins, destroyed at the end.
	raw.CreateNATNetwork(t, ctlNet, ctlBridge, "10.78.0")

	entry := "ctl" + ctlRandHex(t, 3)
	t.Cleanup(func() {
		if err := raw.RemoveEntry(env.Pool, entry); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		if left, err := hostObjects(raw, env.Pool, entry); err != nil || len(left) > 0 {
			t.Errorf("cleanup: left on the host: %v (%v)", left, err)
		}
	})

	// The image server (the library fetches the base from it) and the
	// CONNECT target on the bridge, which answers with a token.
	imgSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/guest.qcow2" {
			http.NotFound(w, r)
			return
		}
		http.ServeFile(w, r, image)
	}))
	t.Cleanup(imgSrv.Close)
	token := "egp-ctl-" + ctlRandHex(t, 8)
	ln, err := net.Listen("tcp", net.JoinHostPort(ctlGateway, "0"))
	if err != nil {
		t.Fatalf("listen on the bridge address: %v", err)
	}
	target := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, token) }), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		target.Serve(ln)
	}()
	t.Cleanup(func() {
		target.Close()
		<-served
	})

	// The config, exactly as a newcomer gets it from the stack script (this
	// tree's version of it), plus a console log directory for failures.
	script, err := filepath.Abs(filepath.Join("..", "..", "scripts", "teststack"))
	if err != nil {
		t.Fatal(err)
	}
	owner := "ctl-e2e"
	gen := exec.CommandContext(ctx, script, "ctl-config", "--entry", entry, "--owner", owner, "--network", ctlNet, "--image-url", imgSrv.URL+"/guest.qcow2")
	gen.Stderr = os.Stderr
	cfgText, err := gen.Output()
	if err != nil {
		t.Fatalf("%s ctl-config: %v", script, err)
	}
	consoleDir := t.TempDir()
	cfgText = append(cfgText, fmt.Sprintf("    consoleLogDir: %q\n", consoleDir)...)
	cfgPath := filepath.Join(t.TempDir(), "ctl.yaml")
	if err := os.WriteFile(cfgPath, cfgText, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("config:\n%s", cfgText)
	for _, want := range []string{`domainType: "qemu"`, `sha256: "` + sum + `"`, "kernel:", `network: "` + ctlNet + `"`} {
		if !strings.Contains(string(cfgText), want) {
			t.Fatalf("ctl-config output lacks %s", want)
		}
	}
	udPath := filepath.Join(t.TempDir(), "user-data")
	if err := os.WriteFile(udPath, []byte(ctlUserData), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		ents, _ := os.ReadDir(consoleDir)
		for _, e := range ents {
			b, _ := os.ReadFile(filepath.Join(consoleDir, e.Name()))
			if len(b) > 32<<10 {
				b = b[len(b)-32<<10:]
			}
			t.Logf("--- console %s (tail) ---\n%s", e.Name(), b)
		}
	})

	cli := &ctlCLI{t: t, ctx: ctx, bin: buildBinary(t), config: cfgPath}

	// check
	out := cli.want(exitOK, "-o", "json", "check")
	if c := ctlJSON[checkJSON](t, out); len(c.Entries) != 1 || !c.Entries[0].Reachable || c.Entries[0].Details["poolState"] != "running" {
		t.Fatalf("check: %+v", c)
	} else if cp := c.Entries[0].Capacity; cp == nil || cp.PoolAvailableBytes <= 0 || cp.MemoryAvailableBytes <= 0 || cp.CPUs <= 0 {
		t.Fatalf("check: the host's capacity %+v, want its pool's free bytes, memory and CPUs", cp)
	}

	// create: cold fetch of the guest image, boot under TCG, wait for an
	// address.
	uid := "uid-ctl-" + ctlRandHex(t, 6)
	t0 := time.Now()
	out = cli.want(exitOK, "-o", "json", "create", "proxy-a", "--uid", uid, "--port", fmt.Sprint(ctlSquidPort), "--user-data-file", udPath, "--wait", ctlRunningBound.String())
	created := ctlJSON[lsJSON](t, out)
	if len(created.Instances) != 1 || created.Instances[0].State != "Running" || created.Instances[0].UID != uid {
		t.Fatalf("create: %+v", created)
	}
	inst := created.Instances[0]
	host, _, _ := net.SplitHostPort(inst.Address)
	if _, subnet, _ := net.ParseCIDR(ctlSubnet); !subnet.Contains(net.ParseIP(host)) {
		t.Fatalf("address %s not in %s", inst.Address, ctlSubnet)
	}
	t.Logf("create -wait: Running at %s (source %s) %s after start", inst.Address, inst.AddressSource, time.Since(t0).Round(time.Second))

	// ls: people's table and the JSON agree.
	out = cli.want(exitOK, "ls")
	if !strings.Contains(out, "proxy-a") || !strings.Contains(out, inst.Address) || !strings.Contains(out, "Running") {
		t.Fatalf("ls table:\n%s", out)
	}
	ls := ctlJSON[lsJSON](t, cli.want(exitOK, "ls", "-o", "json"))
	if len(ls.Instances) != 1 || ls.Instances[0].Address != inst.Address || ls.Instances[0].Entry != entry {
		t.Fatalf("ls json: %+v", ls)
	}

	// probe: Squid starts after the guest has its address; until then the
	// probe fails as Transient (exit 3), then passes with the token.
	var pr probeRow
	var last string
	if !eventually.PollEvery(ctx, ctlSquidBound, 3*time.Second, func() bool {
		code, out, errs := cli.run("-o", "json", "probe", "proxy-a", "--target", ln.Addr().String(), "--expect-body", token, "--probe-timeout", "15s")
		if code != exitOK && code != exitTransient {
			t.Fatalf("probe: exit %d, want 0 or 3 (not yet)\n%s", code, errs)
		}
		last = errs
		if code == exitOK {
			pr = ctlJSON[probeRow](t, out)
		}
		return code == exitOK
	}) {
		t.Fatalf("Squid never answered within %s of Running: %s", ctlSquidBound, last)
	}
	if !pr.OK || pr.StatusCode != 200 || pr.Proxy != inst.Address {
		t.Fatalf("probe: %+v", pr)
	}
	t.Logf("probe: CONNECT %s via %s → %d in %d ms", pr.Target, pr.Proxy, pr.StatusCode, pr.LatencyMS)

	// images ls: the guest base is present and used by proxy-a, so it
	// cannot be evicted.
	im := ctlJSON[imagesJSON](t, cli.want(exitOK, "images", "ls", "-o", "json"))
	if len(im.Images) != 1 || im.Images[0].Key != "guest" || !im.Images[0].Present || im.Images[0].Digest != sum || strings.Join(im.Images[0].InUseBy, ",") != "proxy-a" {
		t.Fatalf("images ls: %+v", im)
	}
	cli.want(exitPermanent, "images", "evict", "guest") // in use

	// gc --dry-run with a keep file that does not list proxy-a: it would be
	// deleted, and stays.
	keep := filepath.Join(t.TempDir(), "keep")
	if err := os.WriteFile(keep, []byte("# nothing of this test\nuid-someone-else\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	g := ctlJSON[gcJSON](t, cli.want(exitOK, "-o", "json", "gc", "--owner", owner, "--keep-file", keep, "--dry-run"))
	if !g.DryRun || len(g.Instances) != 1 || g.Instances[0].UID != uid || g.Instances[0].Action != "would delete" {
		t.Fatalf("gc -dry-run: %+v", g)
	}
	if ls := ctlJSON[lsJSON](t, cli.want(exitOK, "-o", "json", "ls")); len(ls.Instances) != 1 {
		t.Fatalf("gc -dry-run deleted: %+v", ls)
	}

	// delete, then nothing is left for gc.
	if out := cli.want(exitOK, "delete", "proxy-a"); !strings.Contains(out, "deleted proxy-a (uid "+uid+") on "+entry) {
		t.Fatalf("delete: %s", out)
	}
	if ls := ctlJSON[lsJSON](t, cli.want(exitOK, "-o", "json", "ls")); len(ls.Instances) != 0 {
		t.Fatalf("ls after delete: %+v", ls)
	}
	cli.want(exitNotFound, "probe", "proxy-a", "--target", ln.Addr().String())
	g = ctlJSON[gcJSON](t, cli.want(exitOK, "-o", "json", "gc", "--owner", owner, "--keep-file", keep, "--dry-run"))
	if len(g.Instances) != 0 {
		t.Fatalf("gc -dry-run after delete: %+v", g)
	}
	left, err := hostObjects(raw, env.Pool, entry)
	if err != nil {
		t.Fatal(err)
	}
	// Only the shared base may remain (delete never removes it).
	for _, o := range left {
		if !strings.HasPrefix(o, "volume base-") {
			t.Fatalf("after delete: %s left on the host", o)
		}
	}
}
