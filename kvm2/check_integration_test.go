//go:build integration

package kvm2

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/go-logr/logr/testr"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// stackConfig is a Config that reaches the real test stack.
func stackConfig(t *testing.T) Config {
	t.Helper()
	env := teststack.Require(t)
	return Config{
		Entry:          "itest",
		Owner:          "kvm2-tests",
		Address:        env.SSHAddr,
		User:           env.SSHUser,
		KeyFile:        env.SSHKey,
		KnownHostsFile: env.KnownHosts,
		LibvirtSocket:  env.LibvirtSocket,
		LibvirtURI:     env.LibvirtURI,
		Pool:           env.Pool,
		DialTimeout:    5 * time.Second,
		// The test machines offer KVM but KVM guests hang in their firmware
		// (docs/config.md, STACK.md): pin TCG. accel_integration_test.go
		// tests the automatic choice.
		DomainType: "qemu",
	}
}

func openT(t *testing.T, cfg Config, log logr.Logger) *provider {
	t.Helper()
	p, err := open(context.Background(), cfg, &Options{Logger: log})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p
}

func checkT(t *testing.T, p *provider) egressproxy.Health {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := p.Check(ctx)
	if err != nil {
		t.Fatalf("Check returned a call error: %v", err)
	}
	return h
}

func TestIntegrationCheckReachable(t *testing.T) {
	p := openT(t, stackConfig(t), testr.New(t))
	h := checkT(t, p)
	if !h.Reachable || h.Reason != egressproxy.ReasonNone {
		t.Fatalf("Check = %+v, want reachable", h)
	}
	host, _ := os.Hostname()
	if got := h.Details["hostname"]; got == "" || (host != "" && got != host) {
		t.Errorf("hostname = %q, want %q", got, host)
	}
	if got := h.Details["libvirtVersion"]; !regexp.MustCompile(`^\d+\.\d+\.\d+$`).MatchString(got) || got == "0.0.0" {
		t.Errorf("libvirtVersion = %q", got)
	}
	if got := h.Details["poolState"]; got != "running" {
		t.Errorf("poolState = %q, want running", got)
	}
	free, err := strconv.ParseFloat(h.Details["poolFreeGiB"], 64)
	if err != nil || free <= 0 {
		t.Errorf("poolFreeGiB = %q (%v), want a positive number", h.Details["poolFreeGiB"], err)
	}
	if h.CheckedAt.IsZero() {
		t.Error("CheckedAt is zero")
	}
	// A second Check reuses the connection and still answers.
	if h2 := checkT(t, p); !h2.Reachable {
		t.Errorf("second Check = %+v", h2)
	}
}

func writeFile(t *testing.T, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// unknownKeyFile writes a freshly generated private key that no
// authorized_keys lists.
func unknownKeyFile(t *testing.T) string {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	return writeFile(t, "id_other", pem.EncodeToMemory(block))
}

// otherHostKeyKnownHosts writes a known_hosts that pins another key for addr.
func otherHostKeyKnownHosts(t *testing.T, addr string) string {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	sp, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	line := knownhosts.Line([]string{knownhosts.Normalize(addr)}, sp)
	return writeFile(t, "known_hosts", []byte(line+"\n"))
}

func TestIntegrationCheckReasons(t *testing.T) {
	env := teststack.Require(t)
	tests := []struct {
		name   string
		mutate func(t *testing.T, c *Config)
		want   egressproxy.HealthReason
	}{
		{"missing key file", func(t *testing.T, c *Config) { c.KeyFile = filepath.Join(t.TempDir(), "absent") }, egressproxy.ReasonCredentialsUnavailable},
		{"unreadable key file", func(t *testing.T, c *Config) { c.KeyFile = writeFile(t, "garbage", []byte("not a key\n")) }, egressproxy.ReasonCredentialsUnavailable},
		{"key not authorized", func(t *testing.T, c *Config) { c.KeyFile = unknownKeyFile(t) }, egressproxy.ReasonUnauthorized},
		{"empty known_hosts", func(t *testing.T, c *Config) { c.KnownHostsFile = writeFile(t, "known_hosts", nil) }, egressproxy.ReasonHostKeyUnknown},
		{"known_hosts with another key", func(t *testing.T, c *Config) { c.KnownHostsFile = otherHostKeyKnownHosts(t, c.Address) }, egressproxy.ReasonHostKeyMismatch},
		{"socket the user cannot open", func(t *testing.T, c *Config) { c.User = env.UnprivUser }, egressproxy.ReasonForbidden},
		{"pool missing", func(t *testing.T, c *Config) { c.Pool = "egressproxy-no-such-pool" }, egressproxy.ReasonPoolNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := stackConfig(t)
			tt.mutate(t, &cfg)
			p := openT(t, cfg, testr.New(t))
			h := checkT(t, p)
			if h.Reachable || h.Reason != tt.want {
				t.Fatalf("Check = reachable %v reason %q (%s), want reason %q", h.Reachable, h.Reason, h.Message, tt.want)
			}
			if h.Message == "" {
				t.Error("Message is empty")
			}
		})
	}
}

// rawLibvirt runs fn on a libvirt connection to the stack that does not
// belong to the provider under test.
func rawLibvirt(t *testing.T, fn func(*libvirt.Libvirt) error) error {
	t.Helper()
	cfg := stackConfig(t)
	pool, err := sshconn.New(sshconn.Config{Address: cfg.Address, User: cfg.User, KeyFile: cfg.KeyFile, KnownHostsFile: cfg.KnownHostsFile}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	lv := libvirtconn.New(pool, libvirtconn.Config{Socket: cfg.LibvirtSocket, URI: cfg.LibvirtURI}, nil)
	defer lv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return lv.Do(ctx, fn)
}

func TestIntegrationCheckPoolNotActive(t *testing.T) {
	cfg := stackConfig(t)
	err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		sp, err := l.StoragePoolLookupByName(cfg.Pool)
		if err != nil {
			return err
		}
		return l.StoragePoolDestroy(sp)
	})
	if err != nil {
		t.Fatalf("stop pool: %v", err)
	}
	t.Cleanup(func() {
		err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
			sp, err := l.StoragePoolLookupByName(cfg.Pool)
			if err != nil {
				return err
			}
			return l.StoragePoolCreate(sp, 0)
		})
		if err != nil {
			t.Errorf("restart pool %s: %v", cfg.Pool, err)
		}
	})
	p := openT(t, cfg, testr.New(t))
	h := checkT(t, p)
	if h.Reachable || h.Reason != egressproxy.ReasonPoolNotActive {
		t.Fatalf("Check = reachable %v reason %q (%s), want PoolNotActive", h.Reachable, h.Reason, h.Message)
	}
	if got := h.Details["poolState"]; got != "inactive" {
		t.Errorf("poolState = %q, want inactive", got)
	}
	if h.Details["hostname"] == "" || h.Details["libvirtVersion"] == "" {
		t.Errorf("details learnt before the pool check are missing: %v", h.Details)
	}
}

func TestIntegrationCheckSSHDStopped(t *testing.T) {
	cfg := stackConfig(t)
	teststack.Run(t, "sshd-stop")
	t.Cleanup(func() { teststack.Run(t, "sshd-start") })
	p := openT(t, cfg, testr.New(t))
	start := time.Now()
	h := checkT(t, p)
	if h.Reachable || h.Reason != egressproxy.ReasonUnreachable {
		t.Fatalf("Check = reachable %v reason %q (%s), want Unreachable", h.Reachable, h.Reason, h.Message)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("Check took %v with sshd stopped", d)
	}
}

func TestIntegrationCheckAfterLibvirtdRestart(t *testing.T) {
	p := openT(t, stackConfig(t), testr.New(t))
	if h := checkT(t, p); !h.Reachable {
		t.Fatalf("first Check = %+v", h)
	}
	before := teststack.Run(t, "libvirtd-pid")
	teststack.Run(t, "libvirtd-restart")
	if after := teststack.Run(t, "libvirtd-pid"); after == before {
		t.Fatalf("libvirtd pid %s unchanged by the restart", after)
	}
	var last egressproxy.Health
	for i := 0; i < 3; i++ {
		last = checkT(t, p)
		if last.Reachable {
			t.Logf("reachable again on check %d after the restart", i+1)
			return
		}
		t.Logf("check %d after restart: %s (%s)", i+1, last.Reason, last.Message)
	}
	t.Fatalf("not reachable within three Checks after libvirtd restart: %+v", last)
}

func TestIntegrationCheckCallErrors(t *testing.T) {
	p := openT(t, stackConfig(t), testr.New(t))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := p.Check(ctx); errs.Code(err) != errs.Canceled {
		t.Errorf("Check(cancelled ctx) error = %v (code %v), want Canceled", err, errs.Code(err))
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	_, err := p.Check(context.Background())
	if !errors.Is(err, errs.ErrClosed) || errs.Code(err) != errs.Permanent {
		t.Errorf("Check after Close = %v (code %v), want ErrClosed/Permanent", err, errs.Code(err))
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// captureFDs runs fn with file descriptors 1 and 2 redirected to pipes and
// returns what was written to each.
func captureFDs(t *testing.T, fn func()) (stdout, stderr []byte) {
	t.Helper()
	type capture struct {
		r, w  *os.File
		saved int
		buf   []byte
	}
	var caps [2]*capture
	var wg sync.WaitGroup
	for i, fd := range []int{1, 2} {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		saved, err := syscall.Dup(fd)
		if err != nil {
			t.Fatal(err)
		}
		c := &capture{r: r, w: w, saved: saved}
		caps[i] = c
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.buf, _ = io.ReadAll(r)
		}()
	}
	for i, fd := range []int{1, 2} {
		if err := syscall.Dup3(int(caps[i].w.Fd()), fd, 0); err != nil {
			t.Fatal(err)
		}
	}
	func() {
		defer func() {
			for i, fd := range []int{1, 2} {
				_ = syscall.Dup3(caps[i].saved, fd, 0)
				_ = syscall.Close(caps[i].saved)
				_ = caps[i].w.Close()
			}
		}()
		fn()
	}()
	wg.Wait()
	for _, c := range caps {
		_ = c.r.Close()
	}
	return caps[0].buf, caps[1].buf
}

func TestIntegrationNothingOnStdoutStderr(t *testing.T) {
	cfg := stackConfig(t)
	var (
		mu    sync.Mutex
		lines []string
	)
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		lines = append(lines, prefix+" "+args)
		mu.Unlock()
	}, funcr.Options{Verbosity: 10})

	bad := cfg
	bad.KeyFile = unknownKeyFile(t)
	var (
		good, failed egressproxy.Health
		gerr, ferr   error
		cerr1, cerr2 error
	)
	out, errOut := captureFDs(t, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		p, err := open(ctx, cfg, &Options{Logger: log})
		if err != nil {
			gerr = err
			return
		}
		good, gerr = p.Check(ctx)
		cerr1 = p.Close()
		q, err := open(ctx, bad, &Options{Logger: log})
		if err != nil {
			ferr = err
			return
		}
		failed, ferr = q.Check(ctx)
		cerr2 = q.Close()
	})
	if gerr != nil || ferr != nil || cerr1 != nil || cerr2 != nil {
		t.Fatalf("errors: check %v, failing check %v, close %v %v", gerr, ferr, cerr1, cerr2)
	}
	if !good.Reachable {
		t.Errorf("good Check = %+v", good)
	}
	if failed.Reachable || failed.Reason != egressproxy.ReasonUnauthorized {
		t.Errorf("bad-key Check = %+v, want Unauthorized", failed)
	}
	if len(out) != 0 || len(errOut) != 0 {
		t.Errorf("library wrote to stdout %q / stderr %q", out, errOut)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(lines) == 0 {
		t.Error("the logger received no lines")
	}
	joined := strings.Join(lines, "\n")
	for _, want := range []string{"reachable", "Unauthorized"} {
		if !strings.Contains(joined, want) {
			t.Errorf("log lines lack %q:\n%s", want, joined)
		}
	}
}
