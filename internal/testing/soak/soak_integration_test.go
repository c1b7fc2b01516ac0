//go:build integration

package soak

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
	"github.com/egressproxy/egressproxy/internal/testing/lab"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
)

const (
	// convergeBound is the documented convergence time: after the last
	// fault ends, every host's List must equal its desired set (all up),
	// and every tombstone be finalized, within it. A SIGKILLed driver's
	// claim on a cold fetch keeps that base from every other writer of
	// the host until it is stale (imagecache's ClaimTimeout, 2 min, which
	// kvm2 does not let an entry change), so the bound is that plus a
	// minute for the fetch and the requeue backoff.
	convergeBound = 3 * time.Minute
	// rttRaised is the round-trip time of an rtt fault.
	rttRaised = "400ms"
	// samplePeriod is how often the supervisor asks the driver for a
	// settled sample (goroutines, RSS).
	samplePeriod = 10 * time.Second
)

// mirror serves the tiny images with basic auth (the planted URL
// credential must be sent, and never printed) and fails as its mode says.
type mirror struct {
	img        []byte
	user, pass string
	mode       atomic.Value // string: "", "503", "stall", "short"
	resume     chan struct{}
	mu         sync.Mutex
	gets       int
}

func (m *mirror) setMode(s string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	old, _ := m.mode.Load().(string)
	m.mode.Store(s)
	if old == "stall" {
		close(m.resume)
	}
	if s == "stall" {
		m.resume = make(chan struct{})
	}
}

func (m *mirror) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if u, p, ok := r.BasicAuth(); !ok || u != m.user || p != m.pass {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	m.mu.Lock()
	m.gets++
	resume := m.resume
	m.mu.Unlock()
	mode, _ := m.mode.Load().(string)
	switch mode {
	case "503":
		http.Error(w, "mirror down", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(m.img)))
	half := len(m.img) / 2
	switch mode {
	case "short":
		_, _ = w.Write(m.img[:half])
		return // the server closes: the body ends short of its length
	case "stall":
		_, _ = w.Write(m.img[:half])
		w.(http.Flusher).Flush()
		select {
		case <-resume:
		case <-r.Context().Done():
			return
		}
		_, _ = w.Write(m.img[half:])
		return
	}
	_, _ = w.Write(m.img)
}

// shost is one lab host as the supervisor sees it.
type shost struct {
	h     lab.Host
	entry string
	pool  string              // the entry's pool (the tmpfs one on the pool host)
	c     *egressproxy.Client // the supervisor's own client (over the link, not the delay proxy): convergence checks
	fc    *egressproxy.Client // the foreign owner's client
	fref  egressproxy.Ref     // the foreign owner's instance
	plant *foreign
	guest *guestEntry // the guest entry (its own key after the lab's hosts)
}

func (h *shost) name() string {
	if h.guest != nil {
		return fmt.Sprintf("guest entry on host %d", h.h.N)
	}
	return fmt.Sprintf("host %d", h.h.N)
}

// proc is one driver process.
type proc struct {
	role    string
	hosts   []int
	cmd     *exec.Cmd
	pid     int
	started time.Time
	inMu    sync.Mutex
	in      io.WriteCloser
	done    chan struct{} // its stdout ended and it was waited for
	samples chan Event
	exited  chan Event
	stopped atomic.Bool // killed or told to stop: its end is expected
	stderr  string
}

func (p *proc) send(m toDriver) {
	b, _ := json.Marshal(m)
	p.inMu.Lock()
	defer p.inMu.Unlock()
	if p.in != nil {
		_, _ = p.in.Write(append(b, '\n')) // a killed driver: EPIPE, ignored
	}
}

type callKey struct {
	pid int
	id  uint64
}

type inflight struct {
	e       Event
	start   time.Time
	flagged bool
}

type sample struct {
	pid int
	t   time.Time
	gor int
	rss int64
}

// supervisor is TestSoak's state: the desired set (the apiserver's part),
// the driver processes, the fault injector and the checkers.
type supervisor struct {
	t      *testing.T
	env    lab.Env
	seed   uint64
	sfx    string
	log    *Log
	chk    *Checker
	mirror *mirror
	ts     string // scripts/teststack
	hosts  []*shost
	base   driverConfig // config of every driver; Role, Start, Hosts set per start

	mu       sync.Mutex
	desired  map[int]map[string]slotSpec
	deleting map[int]map[string]egressproxy.Ref
	main     *proc
	replicas map[int]*proc
	calls    map[callKey]*inflight
	samples  []sample
	peakRSS  int64
	procs    []*proc

	starts atomic.Uint64
	lines  atomic.Int64
	kills  atomic.Int64

	activeMu sync.Mutex
	active   map[string]bool
}

func (s *supervisor) activeFaults() []string {
	s.activeMu.Lock()
	defer s.activeMu.Unlock()
	var out []string
	for k := range s.active {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// desiredOf is host n's desired set and tombstones, as sent to drivers.
func (s *supervisor) desiredOf(n int) desiredSet {
	s.mu.Lock()
	defer s.mu.Unlock()
	ds := desiredSet{Host: n}
	for _, name := range slices.Sorted(mapsKeys(s.desired[n])) {
		ds.Specs = append(ds.Specs, s.desired[n][name])
	}
	for _, name := range slices.Sorted(mapsKeys(s.deleting[n])) {
		ds.Deleting = append(ds.Deleting, s.deleting[n][name])
	}
	return ds
}

// publish sends host n's desired set to every driver that reconciles it.
func (s *supervisor) publish(n int) {
	ds := s.desiredOf(n)
	s.mu.Lock()
	targets := []*proc{s.main}
	if r := s.replicas[n]; r != nil {
		targets = append(targets, r)
	}
	s.mu.Unlock()
	for _, p := range targets {
		if p != nil {
			p.send(toDriver{Desired: &ds})
		}
	}
}

// spawn starts a driver process reconciling hosts.
func (s *supervisor) spawn(role string, hosts []int) (*proc, error) {
	cfg := s.base
	cfg.Role = role
	cfg.Start = s.starts.Add(1)
	cfg.Hosts = nil
	for _, n := range hosts {
		h := s.hosts[n-1]
		cfg.Hosts = append(cfg.Hosts, driverHost{N: n, Entry: h.entry, Addr: h.h.DelayAddr, User: h.h.SSHUser,
			KeyFile: h.h.SSHKey, KnownHosts: h.h.KnownHosts, Socket: h.h.LibvirtSocket, URI: h.h.LibvirtURI,
			Pool: h.pool, Network: h.h.Network, Guest: h.guest})
	}
	p := &proc{role: role, hosts: hosts, done: make(chan struct{}), samples: make(chan Event, 4), exited: make(chan Event, 1),
		stderr: filepath.Join(os.TempDir(), fmt.Sprintf("soak-%d-driver-%d.stderr", s.seed, cfg.Start))}
	p.cmd = exec.Command(os.Args[0])
	p.cmd.Env = append(os.Environ(), childEnv+"="+role)
	errf, err := os.Create(p.stderr)
	if err != nil {
		return nil, err
	}
	defer errf.Close()
	p.cmd.Stderr = errf
	if p.in, err = p.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := p.cmd.Start(); err != nil {
		return nil, err
	}
	p.pid, p.started = p.cmd.Process.Pid, time.Now()
	s.log.Add(Event{Kind: EvSpawn, PID: p.pid, Detail: fmt.Sprintf("%s of hosts %v (start %d)", role, hosts, cfg.Start)})
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	p.send(toDriver{Config: &cfg})
	for _, n := range hosts { // the desired sets it starts from, then "synced"
		ds := s.desiredOf(n)
		p.send(toDriver{Desired: &ds})
	}
	p.send(toDriver{Synced: true})
	go s.read(p, out)
	return p, nil
}

// read handles p's events until its stdout ends, then reaps it.
func (s *supervisor) read(p *proc, out io.Reader) {
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 64<<10), 8<<20)
	for sc.Scan() {
		var e Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			s.t.Errorf("driver %d: bad event line %q: %v", p.pid, sc.Text(), err)
			continue
		}
		e.PID = p.pid
		s.handle(p, e)
	}
	err := p.cmd.Wait()
	s.mu.Lock()
	for k := range s.calls {
		if k.pid == p.pid {
			delete(s.calls, k)
		}
	}
	s.mu.Unlock()
	if !p.stopped.Load() {
		b, _ := os.ReadFile(p.stderr)
		s.chk.Check(InvDriverAlive, false, fmt.Sprintf("driver %d (%s) ended unasked: %v; stderr: %s", p.pid, p.role, err, tail(string(b), 2000)))
	}
	close(p.done)
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

func (s *supervisor) handle(p *proc, e Event) {
	switch e.Kind {
	case EvLog:
		s.lines.Add(1)
		s.chk.CheckText("log line", e.Detail)
	case EvCallStart:
		s.mu.Lock()
		s.calls[callKey{p.pid, e.ID}] = &inflight{e: e, start: time.Now()}
		s.mu.Unlock()
	case EvCall:
		s.mu.Lock()
		delete(s.calls, callKey{p.pid, e.ID})
		s.mu.Unlock()
		s.log.Add(e)
		s.chk.CheckBudget(e.Op, e.Instance, e.Latency, callBudget(e), budgetGrace)
		if e.Result != "Canceled" {
			s.chk.CheckClass(e.Op, e.Instance, e.Result, e.Err, s.activeFaults())
		}
		if e.Err != "" {
			s.chk.CheckText("error of "+e.Op, e.Err)
		}
	case EvSample:
		select {
		case p.samples <- e:
		default:
		}
	case EvExit:
		s.log.Add(e)
		select {
		case p.exited <- e:
		default:
		}
	case EvFinalized:
		s.log.Add(e)
		s.mu.Lock()
		if r, ok := s.deleting[e.Host][e.Instance]; ok && r.UID == e.Detail {
			delete(s.deleting[e.Host], e.Instance)
		}
		s.mu.Unlock()
		s.publish(e.Host)
	default:
		s.log.Add(e)
	}
}

// watchdog flags every call in flight longer than its budget plus grace
// while it hangs (its end may never come).
func (s *supervisor) watchdog(ctx context.Context) {
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		var late []Event
		var took []time.Duration
		s.mu.Lock()
		for _, c := range s.calls {
			if d := time.Since(c.start); !c.flagged && d > callBudget(c.e)+budgetGrace {
				c.flagged = true
				late = append(late, c.e)
				took = append(took, d)
			}
		}
		s.mu.Unlock()
		for i, e := range late {
			s.chk.CheckBudget(e.Op, fmt.Sprintf("%s (still running in driver %d: a hang)", e.Instance, e.PID), took[i], callBudget(e), budgetGrace)
		}
	}
}

// callBudget is the deadline the driver gave a call (budgetOf its kind
// when it did not say).
func callBudget(e Event) time.Duration {
	if e.Budget > 0 {
		return e.Budget
	}
	return budgetOf(e.Op)
}

// kill SIGKILLs p (the driver-sigkill fault), reading its peak RSS first.
func (s *supervisor) kill(p *proc) {
	p.stopped.Store(true)
	s.notePeak(p)
	s.mu.Lock()
	n := 0
	for k := range s.calls {
		if k.pid == p.pid {
			n++
		}
	}
	s.mu.Unlock()
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	s.kills.Add(1)
	s.log.Add(Event{Kind: EvKilled, PID: p.pid, Detail: fmt.Sprintf("%d calls in flight", n)})
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		s.t.Errorf("driver %d still runs 30 s after SIGKILL", p.pid)
	}
}

// stop ends p cleanly (its stdin closed) and checks what it left.
func (s *supervisor) stop(p *proc) {
	p.stopped.Store(true)
	s.notePeak(p)
	p.inMu.Lock()
	_ = p.in.Close()
	p.in = nil
	p.inMu.Unlock()
	select {
	case e := <-p.exited:
		var start int
		_, _ = fmt.Sscanf(e.Detail, "goroutines at start %d", &start)
		s.chk.Check(InvReleased, e.Gor <= start+2 && e.Err == "",
			fmt.Sprintf("driver %d (%s) after closing every client: %d goroutines (at start %d), close: %q; %s", p.pid, p.role, e.Gor, start, e.Err, tail(e.Detail, 4000)))
	case <-time.After(2 * time.Minute):
		s.chk.Check(InvReleased, false, fmt.Sprintf("driver %d (%s) did not stop within 2m of its stdin closing", p.pid, p.role))
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
	<-p.done
}

func (s *supervisor) notePeak(p *proc) {
	if v, ok := procStatus(strconv.Itoa(p.pid), "VmHWM:"); ok {
		s.mu.Lock()
		s.peakRSS = max(s.peakRSS, v)
		s.mu.Unlock()
	}
}

// sampler asks the main driver for a settled sample every samplePeriod.
func (s *supervisor) sampler(ctx context.Context) {
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
			return
		case <-time.After(samplePeriod):
		}
		s.sampleNow()
	}
}

func (s *supervisor) sampleNow() (sample, bool) {
	x, _, ok := s.sampleDump(false)
	return x, ok
}

// sampleDump is sampleNow, with the driver's goroutines grouped when dump.
func (s *supervisor) sampleDump(dump bool) (sample, string, bool) {
	s.mu.Lock()
	p := s.main
	s.mu.Unlock()
	if p == nil {
		return sample{}, "", false
	}
	p.send(toDriver{Sample: true, Dump: dump})
	select {
	case e := <-p.samples:
		x := sample{pid: p.pid, t: time.Now(), gor: e.Gor, rss: e.RSS}
		s.mu.Lock()
		s.samples = append(s.samples, x)
		s.mu.Unlock()
		s.log.Add(Event{Kind: EvSample, PID: p.pid, Gor: e.Gor, RSS: e.RSS, Detail: e.Detail})
		s.notePeak(p)
		return x, e.Detail, true
	case <-p.done:
	case <-time.After(10 * time.Second):
	}
	return sample{}, "", false
}

func (s *supervisor) script(args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.env.Script, args...)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", s.env.Script, strings.Join(args, " "), err, out)
	}
	return nil
}

// labRTT is the lab's own round-trip time, as scripts/lab rtt takes it.
func (s *supervisor) labRTT() string {
	if s.env.RTT == 0 {
		return "0"
	}
	return strconv.FormatInt(s.env.RTT.Milliseconds(), 10) + "ms"
}

// inject starts fault st and returns the function that heals it.
func (s *supervisor) inject(st Step) (heal func() error, err error) {
	n := strconv.Itoa(st.Host)
	switch st.Kind {
	case FaultSSHDFreeze:
		thaw, _, err := teststack.FreezeSSHD(s.hosts[st.Host-1].h.StackDir)
		return func() error { thaw(); return nil }, err
	case FaultSSHDKill:
		if err := s.script("exec", n, s.ts, "sshd-stop"); err != nil {
			return nil, err
		}
		return func() error { return s.script("exec", n, s.ts, "sshd-start") }, nil
	case FaultLinkDown:
		if err := s.script("link", n, "down"); err != nil {
			return nil, err
		}
		return func() error { return s.script("link", n, "up") }, nil
	case FaultLinkSlow:
		h := s.hosts[st.Host-1].h
		if err := s.shape(h, slowRate); err != nil {
			return nil, err
		}
		return func() error { return s.shape(h, s.env.Rate) }, nil
	case FaultRTT:
		if err := s.script("rtt", n, rttRaised); err != nil {
			return nil, err
		}
		return func() error { return s.script("rtt", n, s.labRTT()) }, nil
	case FaultLibvirtdRestart:
		err := s.script("exec", n, s.ts, "libvirtd-restart")
		return func() error { return nil }, err
	case FaultPoolFull:
		h := s.hosts[st.Host-1].h
		if err := s.fillPool(h, 64<<10); err != nil {
			return nil, err
		}
		return func() error { return s.emptyPool(h) }, nil
	case FaultDriverKill:
		s.mu.Lock()
		p := s.main
		s.main = nil
		s.mu.Unlock()
		s.kill(p)
		return func() error {
			np, err := s.spawn("driver", s.allHosts())
			if err != nil {
				return err
			}
			s.mu.Lock()
			s.main = np
			s.mu.Unlock()
			for _, n := range s.allHosts() {
				s.publish(n)
			}
			return nil
		}, nil
	case FaultReplica:
		p, err := s.spawn("replica", []int{st.Host})
		if err != nil {
			return nil, err
		}
		s.mu.Lock()
		s.replicas[st.Host] = p
		s.mu.Unlock()
		s.publish(st.Host)
		return func() error {
			s.mu.Lock()
			delete(s.replicas, st.Host)
			s.mu.Unlock()
			s.stop(p)
			return nil
		}, nil
	case FaultMirror503, FaultMirrorStall, FaultMirrorShort:
		s.mirror.setMode(strings.TrimPrefix(string(st.Kind), "mirror-"))
		return func() error { s.mirror.setMode(""); return nil }, nil
	}
	return nil, fmt.Errorf("unknown fault %s", st.Kind)
}

// keyOf is h's key in the desired set and the drivers' events: its lab
// host's number, or the guest entry's own key.
func (s *supervisor) keyOf(h *shost) int { return slices.Index(s.hosts, h) + 1 }

func (s *supervisor) allHosts() []int {
	var out []int
	for i := range s.hosts {
		out = append(out, i+1)
	}
	return out
}

// slowRate is the link rate of a link-slow fault.
const slowRate = "1mbit"

// shape sets host h's link rate, both directions, as scripts/lab does
// (tbf, burst 2 ms at the rate and at least 64 KiB, latency 10 ms).
func (s *supervisor) shape(h lab.Host, rate string) error {
	bits, err := rateBits(rate)
	if err != nil {
		return err
	}
	args := []string{"qdisc", "replace", "dev", h.Link, "root", "tbf", "rate", strconv.FormatInt(bits, 10) + "bit",
		"burst", strconv.FormatInt(max(bits/8/500, 65536), 10), "latency", "10ms"}
	if out, err := exec.Command("tc", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("tc %s: %v: %s", strings.Join(args, " "), err, out)
	}
	args[3] = "lab0" // the host's end (scripts/lab's HOST_IF)
	return s.script(append([]string{"exec", strconv.Itoa(h.N), "tc"}, args...)...)
}

// rateBits parses a tc rate such as "1gbit", "100mbit", "1mbit".
func rateBits(s string) (int64, error) {
	mult := int64(1)
	num := strings.TrimSuffix(s, "bit")
	for suf, m := range map[string]int64{"k": 1e3, "m": 1e6, "g": 1e9} {
		if n, ok := strings.CutSuffix(num, suf); ok {
			num, mult = n, m
			break
		}
	}
	v, err := strconv.ParseInt(num, 10, 64)
	if err != nil || v <= 0 || !strings.HasSuffix(s, "bit") {
		return 0, fmt.Errorf("link rate %q: want N[k|m|g]bit", s)
	}
	return v * mult, nil
}

func hexRand(n int) string { return hex.EncodeToString(randBytes(n)) }

// verifyList lists host h with the supervisor's own client and diffs it
// with the desired set; tombstones not finalized count as differences.
func (s *supervisor) verifyList(ctx context.Context, h *shost) []string {
	key := s.keyOf(h)
	cctx, cancel := context.WithTimeout(ctx, budgetRead)
	defer cancel()
	start := time.Now()
	list, err := h.c.List(cctx)
	s.chk.CheckBudget("verify-list", "", time.Since(start), budgetRead, budgetGrace)
	if err != nil {
		return []string{fmt.Sprintf("%s: list: %v", h.name(), err)}
	}
	s.mu.Lock()
	want := map[string]string{}
	for n, x := range s.desired[key] {
		want[n] = x.UID
	}
	var pending []string
	for n, r := range s.deleting[key] {
		if _, ok := want[n]; !ok {
			pending = append(pending, fmt.Sprintf("%s: tombstone %s/%s not finalized", h.name(), n, r.UID))
		}
	}
	s.mu.Unlock()
	var obs []Observed
	for _, in := range list {
		obs = append(obs, Observed{Name: in.Name, UID: in.UID, State: string(in.State)})
	}
	up := upStates
	if h.guest != nil {
		up = []string{string(egressproxy.StateRunning)} // it boots: up means an address
	}
	var out []string
	for _, x := range Diff(want, obs, up...) {
		out = append(out, fmt.Sprintf("%s: %s", h.name(), x))
	}
	sort.Strings(pending)
	return append(out, pending...)
}

// TestSoak is the chaos soak (docs/soak.md): SOAK=5m (a
// duration) runs it on the lab in the environment; without SOAK it is
// skipped, whatever CI says — make test and make soak run it. SOAK_SEED
// replays a run; SOAK_REPORT names the report to write, SOAK_EVENTS the
// event log (default: in the temp dir, named by the seed). SOAK_FAULTS
// (kinds, comma-separated) and SOAK_FAULT_EVERY (the mean interval)
// reshape the fault schedule, to chase one kind.
//
// The model operator (the driver) runs in a process of its own, this test
// binary re-executed (driver_integration_test.go); the test is its
// apiserver (the desired set, with tombstones), its fault injector (which
// SIGKILLs and restarts it, among others) and its checker.
func TestSoak(t *testing.T) {
	if os.Getenv("SOAK") == "" {
		t.Skip("SOAK unset: the chaos soak runs only when asked (make soak SOAK=5m)")
	}
	dur, err := time.ParseDuration(os.Getenv("SOAK"))
	if err != nil || dur < 2*time.Minute {
		t.Fatalf("SOAK=%q: want a duration of at least 2m", os.Getenv("SOAK"))
	}
	seed, err := ParseSeed(os.Getenv("SOAK_SEED"))
	if err != nil {
		t.Fatal(err)
	}
	env := lab.Require(t)
	runStart := time.Now()
	p := DefaultParams(seed, dur, len(env.Hosts))
	if v := os.Getenv("SOAK_FAULT_EVERY"); v != "" { // a denser (or sparser) fault schedule
		if p.FaultEvery, err = time.ParseDuration(v); err != nil || p.FaultEvery <= 0 {
			t.Fatalf("SOAK_FAULT_EVERY=%q: want a positive duration", v)
		}
	}
	if v := os.Getenv("SOAK_FAULTS"); v != "" { // e.g. driver-sigkill,pool-full: only these kinds
		for _, k := range strings.Split(v, ",") {
			if !Kind(k).IsFault() {
				t.Fatalf("SOAK_FAULTS: %q is not a fault kind (%v)", k, FaultKinds)
			}
			p.Faults = append(p.Faults, Kind(k))
		}
	}
	steps, err := NewSchedule(p)
	if err != nil {
		t.Fatal(err)
	}
	evPath := os.Getenv("SOAK_EVENTS")
	if evPath == "" {
		evPath = filepath.Join(os.TempDir(), fmt.Sprintf("soak-%d.jsonl", seed))
	}
	evFile, err := os.Create(evPath)
	if err != nil {
		t.Fatal(err)
	}
	defer evFile.Close()
	guestOn := "0"
	if os.Getenv("SOAK_GUEST") == "1" {
		guestOn = "1"
	}
	replay := fmt.Sprintf("make soak SOAK=%s SOAK_SEED=%d SOAK_HOSTS=%d SOAK_GUEST=%s", os.Getenv("SOAK"), seed, len(env.Hosts), guestOn)
	fmt.Printf("SOAK seed %d (%d steps, %d hosts, %v); replay: %s; event log %s\n", seed, len(steps), len(env.Hosts), dur, replay, evPath)

	sfx := hexRand(3)
	urlPass := "soakpw" + hexRand(8)
	userDataSecret := "soakproxypw" + hexRand(8)
	log := NewLog(evFile, nil)
	defer log.Flush()
	chk := NewChecker(log, urlPass, userDataSecret)
	var shown atomic.Int32
	chk.OnViolation = func(v Violation) {
		if shown.Add(1) > 10 {
			return
		}
		var last []string
		for _, e := range log.Last(15) {
			last = append(last, fmt.Sprintf("  %s %s h%d p%d %s %s %s %s %v", e.T.Format("15:04:05.000"), e.Kind, e.Host, e.PID, e.Op, e.Instance, e.Result, e.Err, e.Latency))
		}
		t.Errorf("VIOLATION (seed %d) %s\nlast events:\n%s", seed, v, strings.Join(last, "\n"))
	}
	log.Add(Event{Kind: EvNote, Detail: fmt.Sprintf("seed %d, %d steps, %d hosts, %v", seed, len(steps), len(env.Hosts), dur)})

	// The mirror, with the planted URL credential.
	m := &mirror{img: teststack.TinyQCOW2(t), user: "soak", pass: urlPass}
	m.mode.Store("")
	srv := httptest.NewServer(m)
	defer srv.Close()
	imgSum := sha256.Sum256(m.img)
	s := &supervisor{t: t, env: env, seed: seed, sfx: sfx, log: log, chk: chk, mirror: m,
		ts:      filepath.Join(filepath.Dir(env.Script), "teststack"),
		desired: map[int]map[string]slotSpec{}, deleting: map[int]map[string]egressproxy.Ref{},
		replicas: map[int]*proc{}, calls: map[callKey]*inflight{}, active: map[string]bool{},
		base: driverConfig{Seed: seed, Owner: "soak", ImageURL: strings.Replace(srv.URL, "http://", "http://soak:"+urlPass+"@", 1),
			Digest: hex.EncodeToString(imgSum[:]), Images: p.Images,
			UserData:    "#cloud-config\nchpasswd:\n  list: |\n    proxy:" + userDataSecret + "\n",
			ProbeTarget: "127.0.0.1:9"},
	}

	// The pool host's tmpfs pool, for the pool-full fault.
	if p.PoolHost > 0 {
		undo, err := s.setupTmpfsPool(env.Hosts[p.PoolHost-1])
		if undo != nil {
			defer func() {
				if err := undo(); err != nil {
					t.Errorf("tear down the tmpfs pool: %v", err)
				}
			}()
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, lh := range env.Hosts {
		h := &shost{h: lh, entry: fmt.Sprintf("sk%s%d", sfx, lh.N), pool: lh.Pool}
		if lh.N == p.PoolHost {
			h.pool = tmpfsPoolName
		}
		s.hosts = append(s.hosts, h)
		s.desired[lh.N] = map[string]slotSpec{}
		s.deleting[lh.N] = map[string]egressproxy.Ref{}
	}

	// The guest entry (SOAK_GUEST=1): one proxy of the project's real guest
	// image on lab host 2 (1 on a 1-host lab: never the tmpfs pool's host
	// when there is another), created and booted before the schedule
	// starts and never changed by it, so that health rounds probe a real Squid and a guest
	// really boots from a base the cache verified.
	guestHost := 0
	if os.Getenv("SOAK_GUEST") == "1" {
		img, sum := os.Getenv("EGRESSPROXY_GUEST_IMAGE"), os.Getenv("EGRESSPROXY_GUEST_IMAGE_SHA256")
		if img == "" || sum == "" || os.Getenv("EGRESSPROXY_GUEST_KERNEL") == "" {
			t.Fatal("SOAK_GUEST=1 needs the guest image: eval \"$(scripts/guestimage env)\" (scripts/guestimage build)")
		}
		g := env.Hosts[min(1, len(env.Hosts)-1)]
		files := guesttest.ServeFile(t, "/guest.qcow2", img)
		target := guesttest.ServeTarget(t, g.CallerAddr)
		gh := &shost{h: g, entry: fmt.Sprintf("sk%sg", sfx), pool: g.Pool, guest: &guestEntry{
			URL: files.URL + "/guest.qcow2", SHA256: sum,
			Kernel: os.Getenv("EGRESSPROXY_GUEST_KERNEL"), Initrd: os.Getenv("EGRESSPROXY_GUEST_INITRD"), Cmdline: os.Getenv("EGRESSPROXY_GUEST_CMDLINE"),
			UserData: guesttest.SquidUserData("soak-guest", 3128, g.CallerAddr+"/32"), ProbeTarget: target.Addr,
		}}
		guestHost = len(s.hosts) + 1
		s.hosts = append(s.hosts, gh)
		s.desired[guestHost] = map[string]slotSpec{"guest": {Name: "guest", UID: "guest-" + sfx, Port: 3128, Image: "guest"}}
		s.deleting[guestHost] = map[string]egressproxy.Ref{}
		log.Add(Event{Kind: EvNote, Detail: fmt.Sprintf("guest entry %s on lab host %d is host key %d in this log", gh.entry, g.N, guestHost)})
	}

	// The supervisor's own clients (convergence checks, over the link
	// without the delay proxy) and the foreign objects: volumes and a
	// running domain of "another tool", and an instance of the same entry
	// under another owner (List never shows it, so GC must never touch it).
	consoleDir := t.TempDir()
	for _, h := range s.hosts {
		open := func(owner string) *egressproxy.Client {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cfg := kvm2.Config{Entry: h.entry, Owner: owner,
				Address: h.h.SSHAddr, User: h.h.SSHUser, KeyFile: h.h.SSHKey, KnownHostsFile: h.h.KnownHosts,
				LibvirtSocket: h.h.LibvirtSocket, LibvirtURI: h.h.LibvirtURI, Pool: h.pool, Network: h.h.Network,
				DomainType: "qemu", DefaultImage: "tiny",
				Images:       map[string]imagecache.Image{"tiny": {URL: s.base.ImageURL + "/tiny.qcow2", SHA256: s.base.Digest}},
				MachineTypes: map[string]kvm2.MachineType{"tiny": {VCPUs: 1, MemoryMiB: 64}}}
			if g := h.guest; g != nil { // as the driver's guest entry
				cfg.Images = map[string]imagecache.Image{"guest": {URL: g.URL, SHA256: g.SHA256}}
				cfg.DefaultImage, cfg.MachineTypes = "guest", nil
				cfg.Kernel, cfg.Initrd, cfg.Cmdline = g.Kernel, g.Initrd, g.Cmdline
				cfg.TransferBudget = guestTransfer
				cfg.ConsoleLogDir = consoleDir // the domain is made by this client
			}
			pr, err := kvm2.Open(ctx, cfg, nil)
			if err != nil {
				t.Fatalf("host %d: open %s as %s: %v", h.h.N, h.entry, owner, err)
			}
			c := pr
			t.Cleanup(func() { _ = c.Close() })
			return c
		}
		h.c = open("soak")
		if g := h.guest; g != nil {
			// The guest is made and booted before the schedule starts (its
			// ~570 MB fetch would otherwise meet the first faults, and a
			// SIGKILLed driver's claim holds its base for 2 min): the
			// drivers find it Running through List, the spec theirs.
			t0 := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), budgetGuestCreate)
			x := s.desired[s.keyOf(h)]["guest"]
			spec := egressproxy.Spec{Name: x.Name, UID: x.UID, Port: x.Port, ImageKey: x.Image, UserData: g.UserData}
			in, err := h.c.Create(ctx, spec)
			if err == nil {
				in, err = h.c.WaitRunning(ctx, spec.Ref(), &egressproxy.WaitOptions{Interval: 2 * time.Second})
			}
			if err != nil || in.IP == "" {
				cancel()
				t.Fatalf("the guest on host %d: %v (state %s, ip %q after %v)\n%s", h.h.N, err, in.State, in.IP, time.Since(t0).Round(time.Second),
					guesttest.ConsoleLog(consoleDir, "ep-"+h.entry+"--guest"))
			}
			running := time.Since(t0)
			// Squid starts a while after the address shows (TCG on busy
			// cores): the schedule starts once a probe goes through.
			var res health.Result
			eventually.PollEvery(ctx, budgetGuestCreate, 2*time.Second, func() bool {
				res = health.Probe(ctx, in.Address(), g.ProbeTarget, &health.ProbeOptions{Timeout: 5 * time.Second})
				return res.OK
			})
			cancel()
			if !res.OK {
				t.Fatalf("the guest on host %d at %s: no probe through its Squid went through within %v of its Create: %v\n%s", h.h.N, in.Address(), budgetGuestCreate, res.Err,
					guesttest.ConsoleLog(consoleDir, "ep-"+h.entry+"--guest"))
			}
			log.Add(Event{Kind: EvNote, Host: s.keyOf(h), Detail: fmt.Sprintf("guest created and Running at %s after %v, its Squid answering after %v", in.IP, running.Round(time.Second), time.Since(t0).Round(time.Second))})
			continue // the foreign objects are on the tiny entries' pools
		}
		h.fc = open("soak-foreign")
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		spec := egressproxy.Spec{Name: "foreign", UID: "foreign-" + sfx, MachineType: "tiny"}
		_, err = h.fc.Create(ctx, spec)
		cancel()
		if err != nil {
			t.Fatalf("plant foreign instance on host %d: %v", h.h.N, err)
		}
		h.fref = spec.Ref()
		if h.plant, err = plantForeign(h.h, h.pool, sfx, m.img, h.h.Network); err != nil {
			t.Fatalf("plant foreign objects on host %d: %v", h.h.N, err)
		}
	}
	defer func() { // clean up what the soak made (the lab may be reused)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		for _, h := range s.hosts {
			for _, x := range s.desired[s.keyOf(h)] {
				_ = h.c.Delete(ctx, egressproxy.Ref{Name: x.Name, UID: x.UID})
			}
			for _, r := range s.deleting[s.keyOf(h)] {
				_ = h.c.Delete(ctx, r)
			}
			if h.fc != nil {
				_ = h.fc.Delete(ctx, h.fref)
			}
			if h.plant != nil {
				if err := h.plant.remove(h.h); err != nil {
					t.Logf("host %d: remove foreign objects: %v", h.h.N, err)
				}
			}
		}
	}()

	ctx, stopAll := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { stopAll(); wg.Wait() }()
	wg.Add(3)
	go func() { defer wg.Done(); s.watchdog(ctx) }()
	go func() { defer wg.Done(); s.sampler(ctx) }()
	go func() { // the event log on disk lags by 2 s at most
		defer wg.Done()
		for ctx.Err() == nil {
			_ = log.Flush()
			select {
			case <-ctx.Done():
			case <-time.After(2 * time.Second):
			}
		}
	}()
	first, err := s.spawn("driver", s.allHosts())
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.main = first
	s.mu.Unlock()
	defer func() { // whatever happens, no driver outlives the test
		s.mu.Lock()
		procs := slices.Clone(s.procs)
		s.mu.Unlock()
		for _, p := range procs {
			select {
			case <-p.done:
			default:
				p.stopped.Store(true)
				_ = p.cmd.Process.Signal(syscall.SIGKILL)
				<-p.done
			}
		}
	}()

	// The schedule.
	start := time.Now()
	var healers sync.WaitGroup
	var lastFaultEnd atomic.Int64
	lastFaultEnd.Store(start.UnixNano())
	sleepUntil := func(t time.Time) { time.Sleep(time.Until(t)) }
	for _, st := range steps {
		sleepUntil(start.Add(st.At))
		log.Add(Event{Kind: EvStep, Op: string(st.Kind), Host: st.Host, Detail: StepDetail(st)})
		if st.Kind.IsFault() {
			heal, err := s.inject(st)
			if err != nil {
				t.Errorf("inject %v: %v", st, err)
				continue
			}
			s.activeMu.Lock()
			s.active[string(st.Kind)] = true
			s.activeMu.Unlock()
			healers.Add(1)
			go func() {
				defer healers.Done()
				time.Sleep(st.Dur)
				if err := heal(); err != nil {
					t.Errorf("heal %v: %v", st, err)
				}
				// Calls that started during the fault may still be
				// returning: the fault counts as active for 2 keepalive
				// periods more in the details.
				log.Add(Event{Kind: EvFaultEnd, Op: string(st.Kind), Host: st.Host})
				lastFaultEnd.Store(time.Now().UnixNano())
				time.Sleep(2 * keepalive * keepalives)
				s.activeMu.Lock()
				delete(s.active, string(st.Kind))
				s.activeMu.Unlock()
			}()
			continue
		}
		name := fmt.Sprintf("px%02d", st.Slot)
		s.mu.Lock()
		old, had := s.desired[st.Host][name]
		switch st.Kind {
		case OpDelete:
			delete(s.desired[st.Host], name)
		default:
			s.desired[st.Host][name] = slotSpec{Name: name, UID: fmt.Sprintf("%s-s%d-g%d", sfx, st.Slot, st.Gen), Port: st.Port, Image: st.Image}
		}
		if had && old.UID != s.desired[st.Host][name].UID {
			// The old instance may linger: a tombstone until a driver has
			// deleted it (as a finalizer would keep the object).
			s.deleting[st.Host][name] = egressproxy.Ref{Name: name, UID: old.UID}
		}
		s.mu.Unlock()
		s.publish(st.Host)
	}
	sleepUntil(start.Add(dur - p.Quiet))
	healers.Wait()
	log.Add(Event{Kind: EvNote, Detail: "schedule done; quiet period"})

	// Convergence: every host's List equals its desired set, all up, and
	// every tombstone finalized.
	lastEnd := time.Unix(0, lastFaultEnd.Load())
	var converged time.Duration
	var diffs []string
	eventually.PollEvery(ctx, time.Until(lastEnd.Add(convergeBound)), 2*time.Second, func() bool {
		diffs = nil
		for _, h := range s.hosts {
			diffs = append(diffs, s.verifyList(ctx, h)...)
		}
		if len(diffs) > 0 {
			return false
		}
		converged = time.Since(lastEnd)
		return true
	})
	chk.Check(InvConverged, len(diffs) == 0, fmt.Sprintf("not converged %v after the last fault: %v", convergeBound, diffs))
	// The rest of the quiet period under the same load (Lists, Gets,
	// Checks, evictions, health rounds), then the fleet must still be
	// converged.
	time.Sleep(time.Until(start.Add(dur)))
	for _, h := range s.hosts {
		d := s.verifyList(ctx, h)
		chk.Check(InvConverged, len(d) == 0, fmt.Sprintf("%s at the end of the quiet period: %v", h.name(), d))
	}
	if guestHost > 0 {
		// The guest was probed healthy through its Squid, and still is.
		var last, healthy Event
		for _, e := range log.Events() {
			if e.Kind == EvCall && e.Op == "health-round" && e.Host == guestHost {
				last = e
				if strings.Contains(e.Detail, "healthy 1") && healthy.T.IsZero() {
					healthy = e
				}
			}
		}
		chk.Check(InvGuestHealthy, strings.HasPrefix(last.Detail, "probed 1 healthy 1"),
			fmt.Sprintf("the guest's last health round at the end: %q (first healthy at %v)", last.Detail, healthy.T))
		if !healthy.T.IsZero() {
			log.Add(Event{Kind: EvNote, Host: guestHost, Detail: fmt.Sprintf("guest first probed healthy %v after the start", healthy.T.Sub(start).Round(time.Second))})
		}
	}
	// The driver's flatness: its last settled sample against one taken
	// after its warm-up (a driver started again after a SIGKILL warms up
	// anew: its own first sample at least warm after its start).
	// The end sample is the least of three, 3 s apart: a call in flight
	// holds goroutines for a moment, a leak holds them in all three.
	var end sample
	var ok bool
	var dump string
	for i := range 3 {
		if i > 0 {
			time.Sleep(3 * time.Second)
		}
		x, d, got := s.sampleDump(i == 2)
		if got && (!ok || x.gor < end.gor || x.gor == end.gor && x.rss < end.rss) {
			end = x
		}
		ok = ok || got
		dump = d
	}
	s.mu.Lock()
	final := s.main
	samples := slices.Clone(s.samples)
	s.mu.Unlock()
	warmup := max(dur/5, time.Minute)
	var warm sample
	var warmed bool
	for _, x := range samples {
		if x.pid == final.pid && x.t.Sub(final.started) >= warmup && x.t.Before(end.t.Add(-samplePeriod)) {
			warm, warmed = x, true
			break
		}
	}
	if !warmed { // started late (a SIGKILL near the quiet period): 30 s of warm-up
		for _, x := range samples {
			if x.pid == final.pid && x.t.Sub(final.started) >= 30*time.Second && x.t.Before(end.t.Add(-samplePeriod)) {
				warm, warmed = x, true
				break
			}
		}
	}
	log.Add(Event{Kind: EvNote, Detail: fmt.Sprintf("flatness of driver %d (started %v before the end): warm %+v, end %+v", final.pid, time.Since(final.started).Round(time.Second), warm, end)})
	if ok && warmed {
		if !chk.CheckGrowth(InvGoroutines, int64(warm.gor), int64(end.gor), 0.10, 5) {
			t.Logf("the driver's goroutines at the end, by where they wait <- who made them:\n%s", dump)
		}
		chk.CheckGrowth(InvRSS, warm.rss, end.rss, 0.10, 4<<20)
	}
	// Stop the driver cleanly: every client closed, nothing left running.
	s.mu.Lock()
	s.main = nil
	s.mu.Unlock()
	s.stop(final)
	stopAll()
	wg.Wait()

	// No orphans, no debris, no base missing or half-written under a
	// domain; foreign objects untouched.
	var lastKill time.Time
	for _, e := range log.Events() {
		if e.Kind == EvKilled {
			lastKill = e.T
		}
	}
	leftByKilled := 0
	for _, h := range s.hosts {
		key := s.keyOf(h)
		vols, err := poolVolumes(h.h, h.pool)
		if err != nil {
			t.Errorf("%s: list volumes: %v", h.name(), err)
			continue
		}
		var names []string
		for n := range s.desired[key] {
			names = append(names, n)
		}
		// The foreign owner's instance shares the entry's prefix.
		vd := VolumeDiff("ep-"+h.entry+"--", names, slices.DeleteFunc(slices.Clone(vols), func(v string) bool { return strings.HasPrefix(v, "ep-"+h.entry+"--foreign") }))
		chk.Check(InvNoOrphans, len(vd) == 0, fmt.Sprintf("%s: %v", h.name(), vd))
		dd, killed := poolDebris(h.entry, vols, lastKill)
		chk.Check(InvDebris, len(dd) == 0, fmt.Sprintf("%s: %v", h.name(), dd))
		leftByKilled += len(killed)
		if len(killed) > 0 {
			log.Add(Event{Kind: EvNote, Host: key, Detail: fmt.Sprintf("left by SIGKILLed drivers, for the next Ensure of the image to take over: %v", killed)})
		}
		backing, paths, err := overlayBackings(h.h, h.pool, h.entry)
		var missing []string
		have := map[string]string{}
		for v, p := range paths {
			have[p] = v
		}
		for ov, b := range backing {
			v, ok := have[b]
			switch {
			case !ok:
				missing = append(missing, ov+" -> "+b+" (gone)")
			case !hasMarker(v, vols):
				missing = append(missing, ov+" -> "+b+" (no digest marker: half-written)")
			}
		}
		sort.Strings(missing)
		chk.Check(InvBaseInUse, err == nil && len(missing) == 0, fmt.Sprintf("%s: overlays whose base is gone or half-written: %v (%v)", h.name(), missing, err))
		if h.guest != nil {
			continue
		}
		fd := h.plant.verify(h.h)
		chk.Check(InvForeign, len(fd) == 0, fmt.Sprintf("host %d: foreign objects: %v", h.h.N, fd))
		gctx, cancel := context.WithTimeout(context.Background(), budgetRead)
		in, err := h.fc.Get(gctx, h.fref)
		cancel()
		chk.Check(InvForeign, err == nil && in.UID == h.fref.UID, fmt.Sprintf("host %d: foreign owner's instance: %v (%+v)", h.h.N, err, in))
	}

	s.mu.Lock()
	peak := max(s.peakRSS, end.rss, warm.rss)
	peakGor := 0
	for _, x := range s.samples {
		peakGor = max(peakGor, x.gor)
	}
	nprocs := len(s.procs)
	s.mu.Unlock()
	guestNote := "guest: none (SOAK_GUEST unset): no proxy boots, so no probe reaches a Squid"
	if guestHost > 0 {
		guestNote = fmt.Sprintf("guest (SOAK_GUEST=1): a second entry on lab host %d (host key %d in the tables) holds one proxy of the project's guest image (scripts/guestimage, ~570 MB, direct kernel boot under TCG, transfer budget %v, create budget %v), created and booted before the schedule starts (the setup's extra minutes) and never changed, up only when Running with an address; its health rounds probe through its Squid to a target on the caller's end of the link, and it must be probed healthy at the end (%s)", s.hosts[guestHost-1].h.N, guestHost, guestTransfer, budgetGuestCreate, InvGuestHealthy)
	}
	meta := Meta{
		Seed: seed, Duration: dur, Elapsed: time.Since(runStart), Hosts: len(env.Hosts), Command: replay,
		Converged: converged, Bound: convergeBound, WarmRSS: warm.rss, EndRSS: end.rss, PeakRSS: peak,
		WarmGor: warm.gor, EndGor: end.gor, PeakGor: peakGor, StartedAt: runStart,
		Notes: []string{
			"up: the tiny image does not boot, so a desired proxy counts as up when its domain runs (State Running or Provisioning: no address)",
			fmt.Sprintf("load: %d..%d desired proxies (tiny non-booting qcow2, 1 vCPU/64 MiB, TCG) over %d kvm2 entries, one per lab host, each reached through the host's delay proxy (lab RTT %v), through egressproxy.Client, in a driver process of its own (the test binary re-executed) that the test feeds the desired set with tombstones of deleted proxies (a finalizer's part) over a pipe; a reconciler per host (List, GC from List, Delete of tombstones, Delete before Create, Transient -> backoff 0.5-8 s, Permanent -> stop and record) and Gets/Checks/ListImages/EvictImage (of an image no desired proxy of the host uses, so that cold fetches meet the mirror's faults)/health.Tracker rounds beside it", p.MinProxies, p.MaxProxies, len(env.Hosts), env.RTT),
			fmt.Sprintf("budgets (every RTT, 400 ms included): create %v, delete %v, list/get/check %v, +%v grace, a call still running past its budget+grace flagged while it hangs; entries: call timeout %v, dial %v, keepalive %v x %d; quiet period %v", budgetCreate, budgetDelete, budgetRead, budgetGrace, callTimeout, dialTimeout, keepalive, keepalives, p.Quiet),
			fmt.Sprintf("planted secrets (image URL password, user-data password) checked in every log line of the drivers (%d) and error", s.lines.Load()),
			fmt.Sprintf("driver processes: %d started, %d SIGKILLed (driver-sigkill: down for the fault's duration, at most %v, then started again with the desired set alone); second-replica: a second driver process for one host (same entry and owner) for the fault's duration, stopped cleanly; every clean stop checked for goroutines left after Close; RSS and goroutines are the driver's (settled samples every %v over the pipe, peak RSS from /proc VmHWM), flatness checked on the last driver process from a sample at least %v after its start", nprocs, s.kills.Load(), p.DriverDownMax, samplePeriod, warmup),
			fmt.Sprintf("debris: no claim (but those taken before the last SIGKILL: %d left, for the next Ensure of their image to take over once stale) and no base without its digest marker (unless a driver was SIGKILLed) may remain in a pool at the end; no overlay may be backed by a base that is gone or has no marker (invariant d)", leftByKilled),
			fmt.Sprintf("pool-full: host %d's entry uses a %s tmpfs pool, filled but for 64 KiB by a planted file for the fault's duration; rtt-400ms: scripts/lab rtt raises the host's delay proxy to %s and back to the lab's RTT", p.PoolHost, tmpfsSize, rttRaised),
			"foreign objects on every host, in the entry's pool, checked byte for byte at the end (sha256 read back through libvirt, inactive domain XML): a random volume, a volume under the old base naming base-tiny.qcow2, a running domain of another tool (no metadata) with its disk volume, and an instance of the same entry under another owner",
			"health rounds (health.Tracker.Round over the last List's instances) probe nothing on the tiny entries: the tiny image never gets an address, so every member is reported without one (the tracker keeps its state, then forgets it after its grace); evict-image's Permanent refusals of a base in use (the foreign owner's instance always uses \"tiny\") are counted as Refused, by design",
			guestNote,
		},
	}
	rep := Summarize(meta, log.Events(), chk)
	if out := os.Getenv("SOAK_REPORT"); out != "" {
		f, err := os.Create(out)
		if err != nil {
			t.Fatal(err)
		}
		if err := rep.Write(f); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
	}
	var b strings.Builder
	_ = rep.Write(&b)
	t.Logf("seed %d: %d calls, %d faults, %d violations; event log %s\n%s", seed, rep.TotalCalls, sum(rep.Faults), len(rep.Violations), evPath, b.String())
	if errors.Is(ctx.Err(), context.Canceled) && len(rep.Violations) > 0 {
		t.Logf("replay: %s", replay)
	}
}
