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
// The -config file (JSON or YAML) lists kvm2 entries (fields of
// kvm2.Config, matched case-insensitively; durations in nanoseconds), the
// Spec template of the proxies, and the CONNECT target to probe through
// them (it must be reachable from the VMs):
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
//
// The program exits 0 when every proxy ran and answered the probe, 1 with a
// message on stderr on any failure, 2 on bad usage.
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
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/kvm2"
	"github.com/egressproxy/egressproxy/provider"
	"github.com/egressproxy/egressproxy/provider/memprovider"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// fleetConfig is the -config file.
type fleetConfig struct {
	// Entries are the kvm2 provider entries; the fleet is spread over them
	// round-robin.
	Entries []kvm2.Config `json:"entries"`
	// Spec is the template of every proxy (Name and UID are set here).
	Spec provider.Spec `json:"spec"`
	// Target is the CONNECT target (host:port) probed through the proxies;
	// the VMs must be able to reach it. Required: the program's own target
	// listens on this machine's loopback, which VMs cannot reach.
	Target string `json:"target"`
	// RunningTimeout is how long the fleet may take to run, e.g. "10m".
	// Empty: 10m.
	RunningTimeout string `json:"runningTimeout"`
}

// Test hooks: tweak the memprovider of the default flow.
var (
	memOptionsHook  func(*memprovider.Options)
	memProviderHook func(*memprovider.Provider)
)

// memProvisionDelay makes provisioning visible in the default flow.
const memProvisionDelay = 300 * time.Millisecond

type backend struct {
	name   string // entry name, for messages
	client *egressproxy.Client
}

type member struct {
	b    *backend
	spec provider.Spec
	inst provider.Instance
	res  health.Result
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
	err := runFleet(ctx, args, stdout, stderr)
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

func runFleet(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	fs := flag.NewFlagSet("simple-fleet", flag.ContinueOnError)
	fs.SetOutput(stderr)
	n := fs.Int("n", 3, "number of proxies (1-50)")
	keep := fs.Bool("keep", false, "do not delete the proxies: kvm2 VMs stay; memprovider proxies keep serving until interrupted")
	config := fs.String("config", "", "JSON or YAML file with kvm2 entries (default: an in-memory fleet)")
	timeout := fs.Duration("timeout", 0, "overall deadline (default 30s in memory, RunningTimeout+2m with -config)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return &failure{code: 2, err: err}
	}
	if fs.NArg() > 0 {
		return &failure{code: 2, err: fmt.Errorf("unexpected arguments %q (flags only)", fs.Args())}
	}
	if *n < 1 || *n > 50 {
		return &failure{code: 2, err: fmt.Errorf("-n %d: want 1 to 50 proxies", *n)}
	}

	// The CONNECT target the probes reach through the proxies.
	tgt, err := startTarget()
	if err != nil {
		return fail("serving the probe target: %v", err)
	}
	defer tgt.close()

	var (
		backends       []*backend
		template       provider.Spec
		target         = tgt.addr
		runningTimeout = 10 * time.Second
		pollEvery      = 100 * time.Millisecond
		inMemory       = *config == ""
	)
	if inMemory {
		o := &memprovider.Options{ServeProxies: true, ProvisionDelay: memProvisionDelay}
		if memOptionsHook != nil {
			memOptionsHook(o)
		}
		p := memprovider.New(o)
		if memProviderHook != nil {
			memProviderHook(p)
		}
		backends = []*backend{{name: "memory", client: egressproxy.New(p, nil)}}
		if *timeout == 0 {
			*timeout = 30 * time.Second
		}
	} else {
		cfg, err := loadConfig(*config)
		if err != nil {
			return err
		}
		runningTimeout = 10 * time.Minute
		if cfg.RunningTimeout != "" {
			if runningTimeout, err = time.ParseDuration(cfg.RunningTimeout); err != nil || runningTimeout <= 0 {
				return fail("%s: runningTimeout %q: want a positive duration like \"10m\"", *config, cfg.RunningTimeout)
			}
		}
		target = cfg.Target
		pollEvery = time.Second
		template = cfg.Spec
		if *timeout == 0 {
			*timeout = runningTimeout + 2*time.Minute
		}
		backends, err = openKVM2(ctx, cfg)
		if err != nil {
			return err
		}
	}
	defer func() {
		for _, b := range backends {
			if cerr := b.client.Close(); cerr != nil && err == nil {
				err = fail("closing provider %s: %v", b.name, cerr)
			}
		}
	}()

	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	start := time.Now()
	since := func() string { return fmt.Sprintf("[%4.1fs]", time.Since(start).Seconds()) }

	for _, b := range backends {
		h, err := b.client.Check(ctx)
		if err != nil {
			return fail("checking provider %s: %v", b.name, err)
		}
		if !h.Reachable {
			return fail("provider %s is not usable: %s: %s", b.name, h.Reason, h.Message)
		}
		fmt.Fprintf(stdout, "%s provider %s reachable (%s)\n", since(), b.name, details(h.Details))
	}

	// Create the fleet.
	runID := randomHex(4)
	fleet := make([]*member, *n)
	for i := range fleet {
		s := template
		s.Name = fmt.Sprintf("fleet-%d", i+1)
		s.UID = fmt.Sprintf("simple-fleet-%s-%d", runID, i+1)
		fleet[i] = &member{b: backends[i%len(backends)], spec: s}
	}
	created := 0
	defer func() {
		if *keep && err == nil {
			return
		}
		// Delete what was created, also after a failure, with a context
		// of its own: ctx may be what failed.
		dctx, dcancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer dcancel()
		for _, m := range fleet[:created] {
			if derr := m.b.client.Delete(dctx, m.spec.Ref()); derr != nil {
				fmt.Fprintf(stderr, "simple-fleet: cleanup: %v\n", derr)
				if err == nil {
					err = fail("deleting the fleet: %v", derr)
				}
				continue
			}
			if err == nil {
				fmt.Fprintf(stdout, "%s deleted %s\n", since(), m.spec.Name)
			}
		}
		if err == nil {
			for _, b := range backends {
				l, lerr := b.client.List(dctx)
				if lerr != nil {
					err = fail("listing provider %s after deleting: %v", b.name, lerr)
					return
				}
				fmt.Fprintf(stdout, "%s provider %s lists %d instance(s) after cleanup\n", since(), b.name, countRun(l, runID))
			}
		}
	}()
	for _, m := range fleet {
		inst, err := m.b.client.Create(ctx, m.spec)
		if err != nil {
			return fail("%v (class %s)", err, provider.Code(err))
		}
		created++
		m.inst = inst
		fmt.Fprintf(stdout, "%s created %s on %s: %s\n", since(), m.spec.Name, m.b.name, inst.State)
	}

	// Wait for Running, reporting progress when it changes.
	wctx, wcancel := context.WithTimeout(ctx, runningTimeout)
	defer wcancel()
	last := ""
	for {
		running := 0
		var parts []string
		for _, m := range fleet {
			if m.inst.State != provider.StateRunning {
				inst, err := m.b.client.Get(wctx, m.spec.Ref())
				switch {
				case err == nil:
					m.inst = inst
				case provider.Code(err) == provider.Transient:
					// A read may fail now and then; the next poll decides.
				case wctx.Err() != nil && ctx.Err() == nil:
					return fail("the fleet did not reach Running within %v: %v", runningTimeout, err)
				default:
					return fail("%v (class %s)", err, provider.Code(err))
				}
			}
			switch m.inst.State {
			case provider.StateRunning:
				running++
			case provider.StateFailed, provider.StateStopped:
				return fail("%s is %s while starting", m.spec.Name, m.inst.State)
			}
			parts = append(parts, m.spec.Name+" "+string(m.inst.State))
		}
		line := fmt.Sprintf("%d/%d running: %s", running, len(fleet), strings.Join(parts, ", "))
		if line != last {
			fmt.Fprintf(stdout, "%s %s\n", since(), line)
			last = line
		}
		if running == len(fleet) {
			break
		}
		select {
		case <-wctx.Done():
			if ctx.Err() != nil {
				return fail("waiting for the fleet: %v", ctx.Err())
			}
			return fail("the fleet did not reach Running within %v (%s)", runningTimeout, line)
		case <-time.After(pollEvery):
		}
	}

	// Probe each proxy with a real CONNECT to the target, and an HTTP
	// request through the tunnel.
	healthy := 0
	for _, m := range fleet {
		m.res = health.Probe(ctx, m.inst.Address(), target, &health.ProbeOptions{
			Timeout:  5 * time.Second,
			Exchange: exchangeFor(target, tgt.addr),
		})
		if m.res.OK {
			healthy++
		}
	}
	fmt.Fprintf(stdout, "%s probed %d proxies through CONNECT %s\n\n", since(), len(fleet), target)
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSTATE\tADDRESS\tLATENCY\tHEALTH")
	for _, m := range fleet {
		status := "healthy"
		if !m.res.OK {
			status = "unhealthy: " + m.res.Kind.String()
			if m.res.Err != nil {
				status += " (" + m.res.Err.Error() + ")"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", m.spec.Name, m.inst.State, m.inst.Address(), m.res.Latency().Round(10*time.Microsecond), status)
	}
	tw.Flush()
	fmt.Fprintln(stdout)
	if healthy != len(fleet) {
		return fail("%d of %d proxies failed the probe", len(fleet)-healthy, len(fleet))
	}
	if *keep {
		if inMemory {
			fmt.Fprintf(stdout, "%s keeping the fleet up; press Ctrl-C to stop\n", since())
			<-ctx.Done()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) && *timeout > 0 {
				fmt.Fprintf(stdout, "%s -timeout reached; stopping\n", since())
			}
			return nil
		}
		for _, m := range fleet {
			fmt.Fprintf(stdout, "kept %s (UID %s) on %s at %s\n", m.spec.Name, m.spec.UID, m.b.name, m.inst.Address())
		}
	}
	return nil
}

func countRun(l []provider.Instance, runID string) int {
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

func loadConfig(path string) (*fleetConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fail("reading -config: %v", err)
	}
	var cfg fleetConfig
	if err := yaml.UnmarshalStrict(data, &cfg); err != nil {
		return nil, fail("%s: %v", path, err)
	}
	if len(cfg.Entries) == 0 {
		return nil, fail("%s: no entries (want at least one kvm2 entry under \"entries\")", path)
	}
	if _, _, err := net.SplitHostPort(cfg.Target); err != nil {
		return nil, fail("%s: target %q: want the host:port the proxies should CONNECT to (reachable from the VMs), e.g. example.com:443", path, cfg.Target)
	}
	return &cfg, nil
}

// openKVM2 opens one client per entry.
func openKVM2(ctx context.Context, cfg *fleetConfig) ([]*backend, error) {
	// The kvm2 lifecycle (Create/Get/Delete/List) is being written; until
	// kvm2.Provider implements provider.Provider, say so instead of
	// pretending.
	if _, ok := any((*kvm2.Provider)(nil)).(provider.Provider); !ok {
		return nil, fail("kvm2 lifecycle not yet available: kvm2.Provider does not implement provider.Provider (Create/Get/Delete/List) in this build")
	}
	var out []*backend
	for i, c := range cfg.Entries {
		kp, err := kvm2.Open(ctx, c, nil)
		if err != nil {
			for _, b := range out {
				b.client.Close()
			}
			return nil, fail("entry %d (%s): %v", i, c.Entry, err)
		}
		out = append(out, &backend{name: c.Entry, client: egressproxy.New(any(kp).(provider.Provider), nil)})
	}
	return out, nil
}

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
