// Command simple-fleet runs a small fleet of egress proxies end to end:
// it creates them through the portable egressproxy.Client, waits for them to
// run (showing progress), probes each with a real HTTP CONNECT through it to
// a target it serves itself (health.Probe), prints a table and deletes them.
//
// With no flags it needs no hypervisor: the proxies are memprovider
// instances, each serving a real CONNECT proxy on 127.0.0.1.
//
//	go run ./examples/simple-fleet            # 3 proxies on memprovider
//	go run ./examples/simple-fleet -n 5
//	go run ./examples/simple-fleet -keep      # keep serving until Ctrl-C
//	go run ./examples/simple-fleet -config fleet.yaml   # kvm2 entries
//
// The -config file (JSON or YAML) lists kvm2 entries, one per hypervisor
// (each one kvm2.Config in the form docs/config.md describes), the Spec
// template of the proxies, and the CONNECT target to probe through them
// (it must be reachable from the VMs, and the VMs from this program). It
// is read by kvm2.ParseEntries: camelCase keys, durations as strings, and
// every problem reported at once, each with its key path and line
// ("line 9: invalid entries[1].images.debian-12.sha256 …"):
//
//	entries:
//	  - entry: lab1
//	    owner: simple-fleet
//	    address: 192.0.2.10:22
//	    user: root
//	    keyFile: /home/me/.ssh/id_ed25519
//	    knownHostsFile: /home/me/.ssh/known_hosts
//	    pool: default
//	    images:
//	      debian-12:
//	        url: https://cloud.debian.org/images/cloud/bookworm/latest/debian-12-genericcloud-amd64.qcow2
//	spec:
//	  imageKey: debian-12
//	  port: 3128
//	target: example.com:443
//	runningTimeout: 10m
//	progressInterval: 1s    # how often a cold image fetch prints progress
//
// The fleet is spread over the entries round-robin. Before creating
// anything it checks every entry at once and prints each one's health
// (reachable or why not, the backend's details, a degraded detail on its
// own line); every entry must be reachable. Entries create their members
// concurrently (each its own in order), and the first Create on a host
// that lacks the image prints the cold fetch's progress.
//
// -until stops the run early: "created" after every Create returned,
// "running" once every member is Running, "healthy" (the default) after
// the probes. Where this program cannot reach the VMs' addresses (the
// lab's hosts keep their guests on isolated networks, docs/lab.md) or the
// image boots no proxy, use "created" or "running"; target may then be left
// out. `scripts/lab fleet-config` writes a config with one entry per lab
// host (docs/lab.md, "simple-fleet on the lab").
//
// The program exits 0 when every proxy got as far as -until asks (and,
// by default, answered the probe), 1 with a message on stderr on any
// failure, 2 on bad usage.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/kvm2"
	"github.com/egressproxy/egressproxy/memprovider"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// memHooks tweak the memprovider of the default flow (tests inject faults
// through them). The zero value changes nothing.
type memHooks struct {
	options  func(*memprovider.Options)
	provider func(*egressproxy.Client, *memprovider.Control)
	guest    func(*guest.Config) // the proxies' description
}

// memProvisionDelay makes provisioning visible in the default flow.
const memProvisionDelay = 300 * time.Millisecond

type backend struct {
	name   string // entry name, for messages
	addr   string // the hypervisor's sshd ("" in memory), for messages
	client *egressproxy.Client
}

// where is " (addr)" for a kvm2 entry, "" in memory.
func (b *backend) where() string {
	if b.addr == "" {
		return ""
	}
	return " (" + b.addr + ")"
}

type member struct {
	b         *backend
	spec      egressproxy.Spec
	attempted bool // Create was called: cleanUp deletes it (a missing one is no error)
	inst      egressproxy.Instance
	res       health.Result
}

// failure is an error with the exit code it ends the program with.
type failure struct {
	code int
	err  error
}

func (f *failure) Error() string { return f.err.Error() }

func fail(format string, args ...any) error {
	return &failure{code: 1, err: fmt.Errorf(format, args...)}
}

// run is the whole program; it writes only to stdout and stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runWith(ctx, args, stdout, stderr, memHooks{})
}

// runWith is run with the memprovider of the default flow tweaked by mem.
func runWith(ctx context.Context, args []string, stdout, stderr io.Writer, mem memHooks) int {
	err := runFleet(ctx, args, stdout, stderr, mem)
	if err == nil {
		return 0
	}
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	code := 1
	var f *failure
	if errors.As(err, &f) {
		code = f.code
	}
	fmt.Fprintf(stderr, "simple-fleet: %v\n", err)
	return code
}

// runFleet runs the fleet through its steps: configure, check the
// providers, create, wait for Running, probe, report, then (deferred, also
// after a failure) delete the fleet and close the providers.
func runFleet(ctx context.Context, args []string, stdout, stderr io.Writer, mem memHooks) (err error) {
	fl, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}

	// The CONNECT target the probes reach through the proxies.
	tgt, err := startTarget()
	if err != nil {
		return fail("serving the probe target: %v", err)
	}
	defer tgt.close()

	r := &fleetRun{stdout: &lockedWriter{w: stdout}, stderr: &lockedWriter{w: stderr}, keep: fl.keep, until: fl.until, ownTarget: tgt.addr, mem: mem}
	if err := r.configure(ctx, fl); err != nil {
		return err
	}
	defer func() { err = r.closeBackends(err) }()

	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	r.start = time.Now()

	if err := r.checkProviders(ctx); err != nil {
		return err
	}
	r.planFleet(fl.n)
	defer func() { err = r.cleanUp(err) }()
	if err := r.createFleet(ctx); err != nil {
		return err
	}
	if r.until != untilCreated {
		if err := r.waitRunning(ctx); err != nil {
			return err
		}
	}
	if r.until == untilHealthy {
		r.probeFleet(ctx)
	}
	if err := r.report(); err != nil {
		return err
	}
	if r.keep {
		r.keepFleet(ctx)
	}
	return nil
}

// flags are the command line's settings.
type flags struct {
	n       int
	keep    bool
	config  string
	until   string
	timeout time.Duration
}

// The stages -until stops after.
const (
	untilCreated = "created"
	untilRunning = "running"
	untilHealthy = "healthy"
)

// parseFlags reads args; bad usage is a failure with exit code 2.
func parseFlags(args []string, stderr io.Writer) (flags, error) {
	var fl flags
	fs := flag.NewFlagSet("simple-fleet", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&fl.n, "n", 3, "number of proxies (1-50)")
	fs.BoolVar(&fl.keep, "keep", false, "do not delete the proxies: kvm2 VMs stay; memprovider proxies keep serving until interrupted")
	fs.StringVar(&fl.config, "config", "", "JSON or YAML file with kvm2 entries (default: an in-memory fleet)")
	fs.StringVar(&fl.until, "until", untilHealthy, "stop after this stage: created (every Create returned), running (every proxy Running), healthy (probed)")
	fs.DurationVar(&fl.timeout, "timeout", 0, "overall deadline (default 30s in memory, RunningTimeout+2m with -config)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return fl, err
		}
		return fl, &failure{code: 2, err: err}
	}
	if fs.NArg() > 0 {
		return fl, &failure{code: 2, err: fmt.Errorf("unexpected arguments %q (flags only)", fs.Args())}
	}
	if fl.n < 1 || fl.n > 50 {
		return fl, &failure{code: 2, err: fmt.Errorf("-n %d: want 1 to 50 proxies", fl.n)}
	}
	switch fl.until {
	case untilCreated, untilRunning, untilHealthy:
	default:
		return fl, &failure{code: 2, err: fmt.Errorf("-until %s: want created, running or healthy", errs.Quote(fl.until))}
	}
	return fl, nil
}

// fleetRun is one run of the program: where it writes, what it runs on and
// the members of its fleet.
type fleetRun struct {
	stdout         io.Writer // a lockedWriter: entries print from goroutines of their own
	stderr         io.Writer // a lockedWriter too
	keep           bool
	until          string           // the stage to stop after (-until)
	inMemory       bool             // the embedded memprovider fleet (no -config)
	timeout        time.Duration    // overall deadline
	ownTarget      string           // the address of the target this program serves
	target         string           // the CONNECT target probed through the proxies
	template       egressproxy.Spec // every member's spec but Name and UID
	runningTimeout time.Duration
	pollEvery      time.Duration
	backends       []*backend
	mem            memHooks // the default flow's memprovider tweaks

	start time.Time // when the fleet's work started (progress times count from it)
	runID string    // makes this run's UIDs unique
	fleet []*member
}

// since is the progress time stamp printed before each line.
func (r *fleetRun) since() string { return fmt.Sprintf("[%4.1fs]", time.Since(r.start).Seconds()) }

// printf prints one progress line, time-stamped.
func (r *fleetRun) printf(format string, args ...any) {
	fmt.Fprintf(r.stdout, "%s %s\n", r.since(), fmt.Sprintf(format, args...))
}

// lockedWriter serialises writes, so lines printed from several goroutines
// (one per entry, and image progress) do not interleave.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// configure sets up the backends: the embedded memprovider without
// -config, one kvm2 provider per entry of the -config file otherwise, with
// their timeouts and target.
func (r *fleetRun) configure(ctx context.Context, fl flags) error {
	r.target = r.ownTarget
	r.runningTimeout = 10 * time.Second
	r.pollEvery = 100 * time.Millisecond
	r.timeout = fl.timeout
	r.inMemory = fl.config == ""
	if r.inMemory {
		o := &memprovider.Options{ServeProxies: true, ProvisionDelay: memProvisionDelay}
		if r.mem.options != nil {
			r.mem.options(o)
		}
		c := memprovider.New(o)
		if r.mem.provider != nil {
			var ctl *memprovider.Control
			c.As(&ctl)
			r.mem.provider(c, ctl)
		}
		r.backends = []*backend{{name: "memory", client: c}}
		if r.timeout == 0 {
			r.timeout = 30 * time.Second
		}
		// The proxies serve this program only, and its target only.
		_, port, _ := net.SplitHostPort(r.ownTarget)
		p, _ := strconv.Atoi(port)
		desc := guest.Config{AllowedClients: []string{"127.0.0.1"}, AllowedDestinations: []guest.Destination{{Ports: []int{p}}}}
		if r.mem.guest != nil {
			r.mem.guest(&desc)
		}
		ud, err := guest.UserData(desc, nil)
		if err != nil {
			return fail("the proxies' description: %v", err)
		}
		r.template.UserData = ud
		return nil
	}
	cfg, err := loadConfig(fl.config)
	if err != nil {
		return err
	}
	if cfg.Target == "" && r.until == untilHealthy {
		return fail("%s: target: required to probe kvm2 proxies (the host:port they CONNECT to, reachable from the VMs; this program's own target is on its loopback); or stop earlier with -until created or -until running", fl.config)
	}
	r.runningTimeout = cfg.RunningTimeout
	r.target = cfg.Target
	r.pollEvery = time.Second
	r.template = cfg.Spec
	if r.timeout == 0 {
		r.timeout = r.runningTimeout + 2*time.Minute
	}
	r.backends, err = r.openKVM2(ctx, cfg)
	return err
}

// closeBackends closes every provider; err is the run's outcome so far,
// which a close failure replaces only when it is nil.
func (r *fleetRun) closeBackends(err error) error {
	for _, b := range r.backends {
		if cerr := b.client.Close(); cerr != nil && err == nil {
			err = fail("closing provider %s: %v", b.name, cerr)
		}
	}
	return err
}

// checkProviders checks every provider at once (each is its own failure
// domain: a dead host's dial timeout must not add to the others' checks),
// prints each one's health in entry order, and fails unless all are
// reachable.
func (r *fleetRun) checkProviders(ctx context.Context) error {
	type result struct {
		h       egressproxy.Health
		err     error
		elapsed time.Duration
	}
	res := make([]result, len(r.backends))
	var wg sync.WaitGroup
	for i, b := range r.backends {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			res[i].h, res[i].err = b.client.Check(ctx)
			res[i].elapsed = time.Since(t0)
		}()
	}
	wg.Wait()
	var bad []string
	for i, b := range r.backends {
		h, err, took := res[i].h, res[i].err, short(res[i].elapsed)
		switch {
		case err != nil:
			r.printf("provider %s%s: check failed after %v: %v", b.name, b.where(), took, err)
			bad = append(bad, fmt.Sprintf("checking provider %s: %v", b.name, err))
		case !h.Reachable:
			r.printf("provider %s%s NOT reachable after %v: %s: %s", b.name, b.where(), took, h.Reason, h.Message)
			bad = append(bad, fmt.Sprintf("provider %s is not usable: %s: %s", b.name, h.Reason, h.Message))
		default:
			r.printf("provider %s%s reachable in %v (%s)", b.name, b.where(), took, details(h.Details))
			if d := h.Details["degraded"]; d != "" {
				r.printf("provider %s degraded: %s", b.name, d)
			}
		}
	}
	if len(bad) > 0 {
		return fail("%s", strings.Join(bad, "; "))
	}
	return nil
}

// planFleet names the n members and spreads them over the backends
// round-robin.
func (r *fleetRun) planFleet(n int) {
	r.runID = randomHex(4)
	r.fleet = make([]*member, n)
	for i := range r.fleet {
		s := r.template
		s.Name = fmt.Sprintf("fleet-%d", i+1)
		s.UID = fmt.Sprintf("simple-fleet-%s-%d", r.runID, i+1)
		r.fleet[i] = &member{b: r.backends[i%len(r.backends)], spec: s}
	}
}

// createFleet creates every member: the entries at once (independent
// hosts), each entry's members in order. The first failure cancels the
// other entries' Creates and is the run's error.
func (r *fleetRun) createFleet(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	problems := r.perEntry(func(b *backend, m *member) (bool, error) {
		t0 := time.Now()
		m.attempted = true
		inst, err := b.client.Create(ctx, m.spec)
		if err != nil {
			cancel()
			return false, err
		}
		m.inst = inst
		r.printf("created %s on %s in %v: %s", m.spec.Name, b.name, short(time.Since(t0)), inst.State)
		return true, nil
	})
	// The first failure that is not the cancellation it caused.
	if first := firstFailure(problems); first != nil {
		return fail("%v (class %s)", first, egressproxy.Code(first))
	}
	return nil
}

// perEntry runs f for every member, the entries at once (independent
// hosts), each entry's members in order; f returns whether to go on
// with the entry's next member and its member's error. It returns each entry's
// first error, once every entry is done.
func (r *fleetRun) perEntry(f func(*backend, *member) (bool, error)) []error {
	problems := make([]error, len(r.backends))
	var wg sync.WaitGroup
	for i, b := range r.backends {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, m := range r.fleet {
				if m.b != b {
					continue
				}
				more, err := f(b, m)
				if problems[i] == nil {
					problems[i] = err
				}
				if !more {
					return
				}
			}
		}()
	}
	wg.Wait()
	return problems
}

// waitRunning waits until every member runs with an address
// (Client.WaitRunning, every member at once), printing each one as it comes
// up. It fails when a member fails or stops, or runningTimeout or ctx ends
// first; the first failure ends the other waits.
func (r *fleetRun) waitRunning(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, r.runningTimeout)
	defer cancel()
	problems := make([]error, len(r.fleet))
	var mu sync.Mutex
	running := 0
	var wg sync.WaitGroup
	for i, m := range r.fleet {
		wg.Add(1)
		go func() {
			defer wg.Done()
			inst, err := m.b.client.WaitRunning(wctx, m.spec.Ref(), &egressproxy.WaitOptions{Interval: r.pollEvery})
			if err != nil {
				problems[i] = err
				cancel()
				return
			}
			mu.Lock()
			defer mu.Unlock()
			m.inst = inst
			running++
			r.printf("%s Running at %s on %s (%d/%d running)", m.spec.Name, inst.Address(), m.b.name, running, len(r.fleet))
		}()
	}
	wg.Wait()
	first := firstFailure(problems)
	switch {
	case first == nil:
		return nil
	case ctx.Err() != nil:
		return fail("waiting for the fleet: %v", ctx.Err())
	case egressproxy.Code(first) == egressproxy.DeadlineExceeded:
		return fail("the fleet did not reach Running within %v: %v", r.runningTimeout, first)
	}
	return fail("%v (class %s)", first, egressproxy.Code(first))
}

// firstFailure is the first of errs that is not the cancellation another
// one caused (nil when all are nil).
func firstFailure(errs []error) error {
	var first error
	for _, err := range errs {
		if err == nil {
			continue
		}
		if c := egressproxy.Code(err); first == nil || (c != egressproxy.Canceled && egressproxy.Code(first) == egressproxy.Canceled) {
			first = err
		}
	}
	return first
}

// probeFleet probes each proxy with a real CONNECT to the target, and an
// HTTP request through the tunnel when the target is our own.
func (r *fleetRun) probeFleet(ctx context.Context) {
	for _, m := range r.fleet {
		m.res = health.Probe(ctx, m.inst.Address(), r.target, &health.ProbeOptions{
			Timeout:  5 * time.Second,
			Exchange: exchangeFor(r.target, r.ownTarget),
		})
	}
	fmt.Fprintf(r.stdout, "%s probed %d proxies through CONNECT %s\n\n", r.since(), len(r.fleet), r.target)
}

// report prints the fleet's table and fails unless every proxy passed the
// probe.
func (r *fleetRun) report() error {
	healthy := 0
	tw := tabwriter.NewWriter(r.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tENTRY\tSTATE\tADDRESS\tLATENCY\tHEALTH")
	for _, m := range r.fleet {
		latency, status := "-", "not probed (-until "+r.until+")"
		if r.until == untilHealthy {
			latency, status = m.res.Latency().Round(10*time.Microsecond).String(), "healthy"
			if m.res.OK {
				healthy++
			} else {
				status = "unhealthy: " + m.res.Kind.String()
				if m.res.Err != nil {
					status += " (" + m.res.Err.Error() + ")"
				}
			}
		}
		addr := m.inst.Address()
		if addr == "" {
			addr = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", m.spec.Name, m.b.name, m.inst.State, addr, latency, status)
	}
	tw.Flush()
	fmt.Fprintln(r.stdout)
	if r.until == untilHealthy && healthy != len(r.fleet) {
		return fail("%d of %d proxies failed the probe", len(r.fleet)-healthy, len(r.fleet))
	}
	return nil
}

// keepFleet is -keep: memprovider proxies serve until ctx ends (Ctrl-C or
// -timeout); kvm2 VMs stay, and it says where.
func (r *fleetRun) keepFleet(ctx context.Context) {
	if r.inMemory {
		fmt.Fprintf(r.stdout, "%s keeping the fleet up; press Ctrl-C to stop\n", r.since())
		<-ctx.Done()
		if errors.Is(ctx.Err(), context.DeadlineExceeded) && r.timeout > 0 {
			fmt.Fprintf(r.stdout, "%s -timeout reached; stopping\n", r.since())
		}
		return
	}
	for _, m := range r.fleet {
		where := "no address yet"
		if a := m.inst.Address(); a != "" {
			where = "at " + a
		}
		fmt.Fprintf(r.stdout, "kept %s (UID %s) on %s, %s, %s\n", m.spec.Name, m.spec.UID, m.b.name, m.inst.State, where)
	}
}

// cleanUp deletes what was created — also after a failure (err is the
// run's outcome), with a context of its own, since the run's may be what
// failed — and lists the providers to show nothing of this run is left.
// With -keep and no failure it leaves the fleet alone.
func (r *fleetRun) cleanUp(err error) error {
	if r.keep && err == nil {
		return nil
	}
	dctx, dcancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer dcancel()
	derrs := r.perEntry(func(b *backend, m *member) (bool, error) {
		if !m.attempted {
			return true, nil
		}
		if derr := b.client.Delete(dctx, m.spec.Ref()); derr != nil {
			fmt.Fprintf(r.stderr, "simple-fleet: cleanup: %v\n", derr)
			return true, derr // the others are still deleted
		}
		if err == nil {
			r.printf("deleted %s", m.spec.Name)
		}
		return true, nil
	})
	for _, derr := range derrs {
		if derr != nil && err == nil {
			err = fail("deleting the fleet: %v", derr)
		}
	}
	if err != nil {
		return err
	}
	for _, b := range r.backends {
		l, lerr := b.client.List(dctx)
		if lerr != nil {
			return fail("listing provider %s after deleting: %v", b.name, lerr)
		}
		fmt.Fprintf(r.stdout, "%s provider %s lists %d instance(s) after cleanup\n", r.since(), b.name, countRun(l, r.runID))
	}
	return nil
}

func countRun(l []egressproxy.Instance, runID string) int {
	n := 0
	for _, inst := range l {
		if strings.HasPrefix(inst.UID, "simple-fleet-"+runID+"-") {
			n++
		}
	}
	return n
}

func details(d map[string]string) string {
	keys := make([]string, 0, len(d))
	for k := range d {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + d[k]
	}
	return strings.Join(parts, " ")
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// openKVM2 opens one client per entry, each reporting its cold image
// fetches' progress.
func (r *fleetRun) openKVM2(ctx context.Context, cfg *fleetConfig) ([]*backend, error) {
	var out []*backend
	for i, c := range cfg.Entries {
		kc, err := kvm2.Open(ctx, c, &kvm2.Options{
			ImageProgress:         r.imageProgress(c.Entry),
			ImageProgressInterval: cfg.ProgressInterval,
		})
		if err != nil {
			for _, b := range out {
				b.client.Close()
			}
			return nil, fail("entry %d (%s): %v", i, c.Entry, err)
		}
		out = append(out, &backend{name: c.Entry, addr: c.Address, client: kc})
	}
	return out, nil
}

// imageProgress prints entry's cold image fetch progress (kvm2's
// Options.ImageProgress: every ProgressInterval and once when the upload
// ends).
func (r *fleetRun) imageProgress(entry string) func(imagecache.Progress) {
	return func(p imagecache.Progress) {
		line := mib(p.Bytes) + " uploaded"
		if p.Total > 0 {
			line = fmt.Sprintf("%s of %s uploaded (%d%%)", mib(p.Bytes), mib(p.Total), p.Bytes*100/p.Total)
		}
		if p.Rate > 0 {
			line += fmt.Sprintf(", %.1f MB/s", p.Rate/1e6)
		}
		r.printf("%s: cold fetch of %s: %s", entry, p.Volume, line)
	}
}

// short rounds a duration for a progress line: to the microsecond below
// a millisecond, to the millisecond above.
func short(d time.Duration) time.Duration {
	if d < time.Millisecond {
		return d.Round(time.Microsecond)
	}
	return d.Round(time.Millisecond)
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// target is the HTTP server the probes reach through the proxies.
type target struct {
	addr  string
	srv   *http.Server
	done  chan struct{}
	close func()
}

const targetBody = "simple-fleet target ok\n"

func startTarget() (*target, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, targetBody)
		}),
		ReadHeaderTimeout: 5 * time.Second,
		ErrorLog:          log.New(io.Discard, "", 0), // write only to the given writers
	}
	srv.SetKeepAlivesEnabled(false)
	t := &target{addr: ln.Addr().String(), srv: srv, done: make(chan struct{})}
	go func() {
		defer close(t.done)
		srv.Serve(ln)
	}()
	t.close = func() {
		srv.Close()
		<-t.done
	}
	return t, nil
}

// exchangeFor proves the tunnel with an HTTP GET to our own target, and
// does nothing more for a foreign target (the CONNECT 2xx is the proof).
func exchangeFor(target, own string) func(context.Context, net.Conn) error {
	if target != own {
		return nil
	}
	return health.HTTPGet(target, targetBody)
}
