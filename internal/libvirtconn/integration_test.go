//go:build integration

package libvirtconn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

func stackConfig(env teststack.Env) sshconn.Config {
	return sshconn.Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts}
}

// stackLibvirt is a Session on a new pool of cfg, both logging to t.
func stackLibvirt(t *testing.T, env teststack.Env, cfg sshconn.Config) (*sshconn.Pool, *Session) {
	t.Helper()
	log := testr.NewWithOptions(t, testr.Options{Verbosity: 1})
	p, err := sshconn.New(cfg, &sshconn.Options{Logger: log})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	l := New(p, Config{Address: cfg.Address, Socket: env.LibvirtSocket, URI: env.LibvirtURI}, &Options{Logger: log})
	t.Cleanup(func() { _ = l.Close() })
	return p, l
}

func TestIntegrationDo(t *testing.T) {
	env := teststack.Require(t)
	want, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	_, l := stackLibvirt(t, env, stackConfig(env))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	h, err := hostname(ctx, l)
	if err != nil {
		t.Fatalf("Do(ConnectGetHostname): %v", err)
	}
	t.Logf("first Do (ssh dial + channel + ConnectToURI + call): %v", time.Since(start))
	if h != want {
		t.Errorf("hostname %q, want %q", h, want)
	}
	var ver uint64
	if err := l.Do(ctx, func(v *libvirt.Libvirt) error {
		var err error
		ver, err = v.ConnectGetLibVersion()
		return err
	}); err != nil || ver == 0 {
		t.Fatalf("ConnectGetLibVersion: %d %v", ver, err)
	}

	d, err := l.Dedicated(ctx)
	if err != nil {
		t.Fatalf("Dedicated: %v", err)
	}
	if h, err := d.L.ConnectGetHostname(); err != nil || h != want {
		t.Errorf("dedicated ConnectGetHostname: %q %v", h, err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("dedicated Close: %v", err)
	}
}

// sshdPidsFor returns the sshd processes serving the given client-side TCP
// addresses: those holding the server end of each connection (the
// privileged monitor and the unprivileged child), found through
// /proc/net/tcp inodes and /proc/*/fd. Only our own sessions are frozen,
// not other users of the stack's sshd.
func sshdPidsFor(t *testing.T, sshdAddr string, clients ...net.Addr) []int {
	t.Helper()
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	hexAddr := func(a string) string {
		host, port, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		ip := net.ParseIP(host).To4()
		n, _ := strconv.Atoi(port)
		return fmt.Sprintf("%02X%02X%02X%02X:%04X", ip[3], ip[2], ip[1], ip[0], n)
	}
	server := hexAddr(sshdAddr)
	inodes := map[string]bool{}
	for _, c := range clients {
		want := hexAddr(c.String())
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) > 9 && f[1] == server && f[2] == want {
				inodes["socket:["+f[9]+"]"] = true
			}
		}
	}
	if len(inodes) != len(clients) {
		t.Fatalf("found %d server sockets for %d clients", len(inodes), len(clients))
	}
	var pids []int
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		fds, _ := os.ReadDir(filepath.Join("/proc", e.Name(), "fd"))
		for _, fd := range fds {
			if l, err := os.Readlink(filepath.Join("/proc", e.Name(), "fd", fd.Name())); err == nil && inodes[l] {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

func signalAll(t *testing.T, pids []int, sig syscall.Signal) {
	t.Helper()
	for _, pid := range pids {
		if err := syscall.Kill(pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
			t.Errorf("kill -%d %d: %v", sig, pid, err)
		}
	}
}

// freezeSSHD SIGSTOPs the stack's sshd listener and the sshd processes
// serving the shared connections of pools (only our own sessions, not other
// users of the stack's sshd); the returned thaw (also a t.Cleanup)
// SIGCONTs them.
func freezeSSHD(ctx context.Context, t *testing.T, env teststack.Env, pools ...*sshconn.Pool) (thaw func()) {
	t.Helper()
	listener, err := strconv.Atoi(teststack.Run(t, "sshd-pid"))
	if err != nil {
		t.Fatal(err)
	}
	var clients []net.Addr
	for _, p := range pools {
		c, err := p.Client(ctx)
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c.LocalAddr())
	}
	tree := append([]int{listener}, sshdPidsFor(t, env.SSHAddr, clients...)...)
	if len(tree) < 1+len(clients) {
		t.Fatalf("sshd processes of our connections not found (pids %v)", tree)
	}
	if slices.Contains(tree[1:], os.Getpid()) {
		t.Fatalf("own pid %d among the sshd pids %v", os.Getpid(), tree)
	}
	t.Logf("SIGSTOP sshd listener and our sessions' processes: %v", tree)
	signalAll(t, tree, syscall.SIGSTOP)
	var once sync.Once
	thaw = func() { once.Do(func() { signalAll(t, tree, syscall.SIGCONT) }) }
	t.Cleanup(thaw)
	return thaw
}

// closeFrozen closes l and then p, whose peer is frozen, and checks that
// each Close returns within about a second.
func closeFrozen(t *testing.T, l *Session, p *sshconn.Pool) {
	t.Helper()
	start := time.Now()
	if err := l.Close(); err != nil {
		t.Logf("Session.Close: %v", err)
	}
	elL := time.Since(start)
	start = time.Now()
	if err := p.Close(); err != nil {
		t.Errorf("Pool.Close: %v", err)
	}
	elP := time.Since(start)
	t.Logf("MEASURE with sshd frozen: Session.Close %v, Pool.Close %v", elL, elP)
	if elL > 1500*time.Millisecond || elP > 1500*time.Millisecond {
		t.Errorf("Close took Session %v / Pool %v, want about 1s at most", elL, elP)
	}
}

// A SIGSTOPped sshd (listener and the processes of our connections): a Do with a 2s ctx
// returns within its budget, keepalives declare the link dead within
// interval*count, Close returns within a second, and after SIGCONT the next
// call succeeds on a fresh connection.
func TestIntegrationFrozenSSHD(t *testing.T) {
	env := teststack.Require(t)
	const iv, count = 200 * time.Millisecond, 3

	// pA: default keepalive (5s*3), longer than the freeze: its stuck call
	// is ended for its caller by the ctx, and the link must survive.
	pA, lA := stackLibvirt(t, env, stackConfig(env))
	// pB: fast keepalive, to measure dead-link detection.
	cfgB := stackConfig(env)
	cfgB.KeepaliveInterval, cfgB.KeepaliveCount = iv, count
	pB, lB := stackLibvirt(t, env, cfgB)
	// pC: only to measure Close with a frozen peer.
	pC, lC := stackLibvirt(t, env, stackConfig(env))

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, l := range []*Session{lA, lB, lC} {
		if _, err := hostname(ctx, l); err != nil {
			t.Fatalf("Do before freeze: %v", err)
		}
	}
	clientA, err := pA.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	clientB, err := pB.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}

	thaw := freezeSSHD(ctx, t, env, pA, pB, pC)
	frozenAt := time.Now()

	// Do with a 2s ctx on the frozen link.
	doneA := make(chan error, 1)
	startA := time.Now()
	go func() {
		c, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := hostname(c, lA)
		doneA <- err
	}()

	// Dead within interval*count (+slack).
	select {
	case <-pB.Done(clientB):
	case <-time.After(10 * time.Second):
		t.Fatal("pool B not dead 10s after SIGSTOP")
	}
	detect := time.Since(frozenAt)
	if !pB.Dead() {
		t.Error("pool B not Dead although its shared connection is Done")
	}
	t.Logf("MEASURE dead-link detection under SIGSTOP: %v (keepalive %v x %d)", detect, iv, count)
	if detect > iv*count+time.Second {
		t.Errorf("dead after %v, want within %v (+1s slack)", detect, iv*count)
	}
	if !lB.Dead() {
		t.Error("Session B not Dead although its link is")
	}

	var errA error
	select {
	case errA = <-doneA:
	case <-time.After(6 * time.Second):
		t.Fatal("Do with a 2s ctx did not return within 6s")
	}
	elA := time.Since(startA)
	t.Logf("MEASURE Do with 2s ctx on frozen sshd returned after %v: %v", elA, errA)
	if !errors.Is(errA, context.DeadlineExceeded) || errKind(errA) != sshconn.KindUnreachable {
		t.Errorf("Do error %v (kind %v), want a deadline, unreachable", errA, errKind(errA))
	}
	if elA > 4*time.Second {
		t.Errorf("Do returned after %v, budget 2s", elA)
	}

	closeFrozen(t, lC, pC)

	thaw()
	for _, tc := range []struct {
		name string
		l    *Session
	}{{"A", lA}, {"B", lB}} {
		start := time.Now()
		if h, err := hostname(ctx, tc.l); err != nil || h == "" {
			t.Fatalf("%s: Do after SIGCONT: %q %v", tc.name, h, err)
		}
		t.Logf("MEASURE %s: first Do after SIGCONT (redial): %v", tc.name, time.Since(start))
	}
	// Pool A's keepalive budget (15s) outlasted the freeze: its caller's
	// ctx ending abandoned the call for that caller only, so the link
	// survived, the late reply was discarded, and A kept its connection.
	if c, err := pA.Client(ctx); err != nil || c != clientA {
		t.Errorf("pool A replaced its connection although liveness never declared it dead (err %v)", err)
	}
}

// After libvirtd restarts between two calls, the next call (or the one
// after) succeeds without any manual reconnect.
func TestIntegrationLibvirtdRestart(t *testing.T) {
	env := teststack.Require(t)
	p, l := stackLibvirt(t, env, stackConfig(env))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := hostname(ctx, l); err != nil {
		t.Fatal(err)
	}
	client, err := p.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := teststack.Run(t, "libvirtd-pid")
	teststack.Run(t, "libvirtd-restart")
	if after := teststack.Run(t, "libvirtd-pid"); after == before {
		t.Fatalf("libvirtd pid unchanged (%s)", after)
	}
	var errs []error
	for i := 1; i <= 2; i++ {
		start := time.Now()
		_, err := hostname(ctx, l)
		t.Logf("MEASURE call %d after libvirtd restart: %v (err %v)", i, time.Since(start), err)
		if err == nil {
			if i > 1 {
				t.Logf("first call after restart failed: %v", errs[0])
			}
			if c, _ := p.Client(ctx); c != client {
				t.Error("the SSH link was redialed although only libvirtd restarted")
			}
			return
		}
		errs = append(errs, err)
	}
	t.Fatalf("no call succeeded after libvirtd restart: %v", errs)
}
