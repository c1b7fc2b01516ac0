//go:build integration

package soak

// The model operator of the soak, as a process of its own: TestSoak
// re-executes the test binary with childEnv set, and TestMain runs
// driverMain instead of the tests. The supervising test plays the
// apiserver: it sends the desired set (and tombstones of deleted proxies,
// as finalizers would keep them) over the driver's stdin and reads its
// events (JSON lines) from its stdout; it SIGKILLs the driver at scheduled
// times and starts it again, so everything the driver knows after a
// restart comes from the supervisor's desired set and from List.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/kvm2"
)

// childEnv, set in a re-executed test binary's environment, makes it a
// driver process (its value is the role, for ps).
const childEnv = "EGRESSPROXY_SOAK_DRIVER"

func init() { childMain = driverMain }

// driverConfig is the first line the supervisor sends a driver. It holds
// the image URL's credential, so it travels over the pipe, never in argv
// or the environment.
type driverConfig struct {
	Role     string       `json:"role"`  // "driver" or "replica"
	Seed     uint64       `json:"seed"`  // with Start, seeds the side load
	Start    uint64       `json:"start"` // the supervisor's count of driver starts
	Owner    string       `json:"owner"`
	Hosts    []driverHost `json:"hosts"`
	ImageURL string       `json:"imageURL"` // + "/" + key + ".qcow2"; carries the planted URL credential
	Digest   string       `json:"digest"`
	Images   []string     `json:"images"`
	// UserData is every spec's user-data (carries the planted proxy
	// password).
	UserData string `json:"userData"`
	// ProbeTarget is the CONNECT target of the health rounds.
	ProbeTarget string `json:"probeTarget"`
}

// driverHost is one kvm2 entry of a driver.
type driverHost struct {
	N          int    `json:"n"`
	Entry      string `json:"entry"`
	Addr       string `json:"addr"` // the host's sshd through its delay proxy
	User       string `json:"user"`
	KeyFile    string `json:"keyFile"`
	KnownHosts string `json:"knownHosts"`
	Socket     string `json:"socket"`
	URI        string `json:"uri"`
	Pool       string `json:"pool"`
	Network    string `json:"network"`
	// Guest, when set, makes this the guest entry: one proxy of the
	// project's real guest image, booted and probed through its Squid.
	Guest *guestEntry `json:"guest,omitempty"`
}

// guestEntry is what the guest entry differs in.
type guestEntry struct {
	URL         string `json:"url"` // the guest image, served by the supervisor
	SHA256      string `json:"sha256"`
	Kernel      string `json:"kernel"`
	Initrd      string `json:"initrd"`
	Cmdline     string `json:"cmdline"`
	UserData    string `json:"userData"`    // Squid's config, allowing the prober's address
	ProbeTarget string `json:"probeTarget"` // a CONNECT target the guest reaches
}

// The guest's image is ~570 MB: its fetch (upload and read-back over the
// host's delay proxy) gets 5 min, its Create 6 min.
const (
	guestTransfer     = 5 * time.Minute
	budgetGuestCreate = 6 * time.Minute
)

// slotSpec is one desired proxy as the supervisor sends it.
type slotSpec struct {
	Name  string `json:"name"`
	UID   string `json:"uid"`
	Port  int    `json:"port"`
	Image string `json:"image"`
}

// desiredSet is one host's desired proxies and tombstones (proxies
// deleted from the desired set whose instance may still exist: the driver
// Deletes them and reports EvFinalized).
type desiredSet struct {
	Host     int               `json:"host"`
	Specs    []slotSpec        `json:"specs"`
	Deleting []egressproxy.Ref `json:"deleting,omitempty"`
}

// toDriver is one line to a driver.
type toDriver struct {
	Config  *driverConfig `json:"config,omitempty"`
	Desired *desiredSet   `json:"desired,omitempty"`
	Sample  bool          `json:"sample,omitempty"`
	// Dump asks for the sample's goroutines, grouped by where they wait
	// (EvSample's Detail).
	Dump bool `json:"dump,omitempty"`
	// Synced ends the initial desired sets (one per host after the
	// config): a driver reconciles nothing before it, as an operator
	// waits for its informers' caches.
	Synced bool `json:"synced,omitempty"`
}

// Budgets of the soak's calls (their context deadlines) and the grace a
// loaded machine gets to return after one: a call later than budget+grace
// breaks InvBudget (a hang). They hold at every RTT the soak injects (the
// lab's, 400 ms for an rtt fault): a Create makes ~30 round trips and a
// tiny base's fetch a few more, 15 s at 400 ms.
const (
	budgetCreate = 90 * time.Second
	budgetDelete = 60 * time.Second
	budgetRead   = 30 * time.Second
	budgetGrace  = 10 * time.Second
	// The entries' liveness budgets: a dead link is noticed within
	// keepalive×count, a dial gives up after dialTimeout, a call without a
	// deadline of its own after callTimeout.
	keepalive   = time.Second
	keepalives  = 3
	dialTimeout = 10 * time.Second
	callTimeout = 20 * time.Second
)

func budgetOf(op string) time.Duration {
	switch op {
	case "create":
		return budgetCreate
	case "delete":
		return budgetDelete
	}
	return budgetRead
}

// dhost is one entry's reconciler state in a driver.
type dhost struct {
	cfg kvm2.Config
	n   int

	mu       sync.Mutex
	c        *egressproxy.Client // nil until opened
	desired  map[string]egressproxy.Spec
	deleting map[string]egressproxy.Ref // name -> ref
	stuck    map[string]string          // UID -> Permanent error: stop, retry only on a new spec
	listed   []egressproxy.Instance     // the last List, for the health rounds
	tracker  *health.Tracker
	guest    *guestEntry // the guest entry's; nil for the tiny ones
}

// createBudget is the deadline of h's Creates.
func (h *dhost) createBudget() time.Duration {
	if h.guest != nil {
		return budgetGuestCreate
	}
	return budgetCreate
}

type driverProc struct {
	cfg    driverConfig
	outMu  sync.Mutex
	out    *bufio.Writer
	ids    atomic.Uint64
	hosts  map[int]*dhost
	logger logr.Logger
}

// emit writes one event line to the supervisor (and flushes: a SIGKILL
// loses at most the line being written).
func (d *driverProc) emit(e Event) {
	if e.T.IsZero() {
		e.T = time.Now()
	}
	b, _ := json.Marshal(e)
	d.outMu.Lock()
	defer d.outMu.Unlock()
	_, _ = d.out.Write(append(b, '\n'))
	_ = d.out.Flush()
}

// driverMain is a driver process: it reads its config, opens one entry
// per host, reconciles the desired sets the supervisor sends until its
// stdin ends, then closes everything and reports what is left.
func driverMain() int {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 64<<10), 4<<20)
	d := &driverProc{out: bufio.NewWriter(os.Stdout), hosts: map[int]*dhost{}}
	if !in.Scan() {
		fmt.Fprintln(os.Stderr, "soak driver: no config on stdin")
		return 2
	}
	var first toDriver
	if err := json.Unmarshal(in.Bytes(), &first); err != nil || first.Config == nil {
		fmt.Fprintf(os.Stderr, "soak driver: bad config line: %v\n", err)
		return 2
	}
	d.cfg = *first.Config
	d.logger = funcr.New(func(prefix, args string) {
		d.emit(Event{Kind: EvLog, Detail: prefix + " " + args})
	}, funcr.Options{Verbosity: 1})
	gor0 := runtime.NumGoroutine()
	d.emit(Event{Kind: EvReady, Gor: gor0, RSS: rss(), Detail: d.cfg.Role})

	images := map[string]imagecache.Image{}
	for _, k := range d.cfg.Images {
		images[k] = imagecache.Image{URL: d.cfg.ImageURL + "/" + k + ".qcow2", SHA256: d.cfg.Digest}
	}
	for _, h := range d.cfg.Hosts {
		cfg := kvm2.Config{
			Entry: h.Entry, Owner: d.cfg.Owner,
			Address: h.Addr, User: h.User, KeyFile: h.KeyFile, KnownHostsFile: h.KnownHosts,
			LibvirtSocket: h.Socket, LibvirtURI: h.URI, Pool: h.Pool, Network: h.Network,
			DomainType: "qemu", Images: images, DefaultImage: d.cfg.Images[0],
			MachineTypes:   map[string]kvm2.MachineType{"tiny": {VCPUs: 1, MemoryMiB: 64}},
			TransferBudget: 45 * time.Second,
			DialTimeout:    dialTimeout, CallTimeout: callTimeout,
			KeepaliveInterval: keepalive, KeepaliveCount: keepalives,
		}
		if g := h.Guest; g != nil {
			cfg.Images = map[string]imagecache.Image{"guest": {URL: g.URL, SHA256: g.SHA256}}
			cfg.DefaultImage, cfg.MachineTypes = "guest", nil
			cfg.Kernel, cfg.Initrd, cfg.Cmdline = g.Kernel, g.Initrd, g.Cmdline
			cfg.TransferBudget = guestTransfer
		}
		tr, err := health.NewTracker(&health.TrackerOptions{Grace: 30 * time.Second, Logger: d.logger})
		if err != nil {
			fmt.Fprintf(os.Stderr, "soak driver: tracker: %v\n", err)
			return 2
		}
		d.hosts[h.N] = &dhost{cfg: cfg, n: h.N, desired: map[string]egressproxy.Spec{}, deleting: map[string]egressproxy.Ref{},
			stuck: map[string]string{}, tracker: tr, guest: h.Guest}
	}

	// The initial desired sets, before any reconcile: without them a
	// driver would take every instance for an orphan.
	handle := func(m toDriver) {
		switch {
		case m.Desired != nil:
			if h := d.hosts[m.Desired.Host]; h != nil {
				h.setDesired(*m.Desired, d.cfg.UserData)
			}
		case m.Sample:
			g, r := settledSample()
			e := Event{Kind: EvSample, Gor: g, RSS: r}
			if m.Dump {
				e.Detail = goroutineSummary()
			}
			d.emit(e)
		}
	}
	for synced := false; !synced; {
		if !in.Scan() {
			fmt.Fprintln(os.Stderr, "soak driver: stdin ended before the desired sets were synced")
			return 2
		}
		var m toDriver
		if err := json.Unmarshal(in.Bytes(), &m); err != nil {
			fmt.Fprintf(os.Stderr, "soak driver: bad line: %v\n", err)
			continue
		}
		synced = m.Synced
		handle(m)
	}

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var wg sync.WaitGroup
	for _, h := range d.hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := mrand.New(mrand.NewPCG(d.cfg.Seed, d.cfg.Start<<8|uint64(h.n)))
			if !d.open(ctx, h) {
				return
			}
			var hw sync.WaitGroup
			hw.Add(1)
			go func() { defer hw.Done(); d.sideLoad(ctx, h, r) }()
			d.reconcile(ctx, h)
			hw.Wait()
		}()
	}
	// The supervisor's lines until stdin ends (the supervisor closes it to
	// stop this driver cleanly).
	for in.Scan() {
		var m toDriver
		if err := json.Unmarshal(in.Bytes(), &m); err != nil {
			fmt.Fprintf(os.Stderr, "soak driver: bad line: %v\n", err)
			continue
		}
		handle(m)
	}
	stop()
	wg.Wait()
	var problems []error
	for _, h := range d.hosts {
		h.mu.Lock()
		c := h.c
		h.mu.Unlock()
		if c != nil {
			problems = append(problems, c.Close())
		}
	}
	// What a clean stop leaves: the goroutines every closed client and
	// ended reconciler should have taken with them.
	time.Sleep(200 * time.Millisecond)
	g, r := settledSample()
	e := Event{Kind: EvExit, Gor: g, RSS: r, Detail: fmt.Sprintf("goroutines at start %d", gor0)}
	if err := errors.Join(problems...); err != nil {
		e.Err = err.Error()
	}
	if g > gor0+2 {
		e.Detail += "\n" + goroutineDump()
	}
	d.emit(e)
	return 0
}

// goroutineSummary counts the goroutines by their top function and the
// function that created them, most first.
func goroutineSummary() string {
	count := map[string]int{}
	for _, g := range strings.Split(goroutineDump(), "\n\n") {
		lines := strings.Split(strings.TrimSpace(g), "\n")
		if len(lines) < 2 {
			continue
		}
		top := lines[1]
		creator := ""
		for i, l := range lines {
			if strings.HasPrefix(l, "created by ") && i+1 < len(lines) {
				creator = strings.TrimSpace(strings.TrimPrefix(l, "created by "))
			}
		}
		if i := strings.LastIndex(top, "("); i > 0 {
			top = top[:i]
		}
		if i := strings.LastIndex(creator, " in goroutine"); i > 0 {
			creator = creator[:i]
		}
		count[top+" <- "+creator]++
	}
	keys := make([]string, 0, len(count))
	for k := range count {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return count[keys[i]] > count[keys[j]] || count[keys[i]] == count[keys[j]] && keys[i] < keys[j]
	})
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%d %s\n", count[k], k)
	}
	return b.String()
}

func goroutineDump() string {
	b := make([]byte, 1<<20)
	return string(b[:runtime.Stack(b, true)])
}

func (h *dhost) setDesired(s desiredSet, userData string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.desired = map[string]egressproxy.Spec{}
	for _, x := range s.Specs {
		sp := egressproxy.Spec{Name: x.Name, UID: x.UID, Port: x.Port, ImageKey: x.Image, MachineType: "tiny", UserData: userData}
		if h.guest != nil {
			sp.MachineType, sp.UserData = "", h.guest.UserData
		}
		h.desired[x.Name] = sp
	}
	h.deleting = map[string]egressproxy.Ref{}
	for _, r := range s.Deleting {
		h.deleting[r.Name] = r
	}
}

func (h *dhost) snapshot() (map[string]egressproxy.Spec, map[string]egressproxy.Ref) {
	h.mu.Lock()
	defer h.mu.Unlock()
	d := make(map[string]egressproxy.Spec, len(h.desired))
	for k, v := range h.desired {
		d[k] = v
	}
	del := make(map[string]egressproxy.Ref, len(h.deleting))
	for k, v := range h.deleting {
		del[k] = v
	}
	return d, del
}

func (h *dhost) client() *egressproxy.Client {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.c
}

// open opens h's entry, retrying while the host is unreachable (a driver
// started during a host fault crash-loops no more than an operator would).
func (d *driverProc) open(ctx context.Context, h *dhost) bool {
	backoff := 500 * time.Millisecond
	for ctx.Err() == nil {
		var pr *egressproxy.Client
		err := d.call(ctx, h.n, "open", "", budgetRead, func(c context.Context) (err error) {
			pr, err = kvm2.Open(c, h.cfg, &kvm2.Options{Logger: d.logger})
			return err
		})
		if err == nil {
			h.mu.Lock()
			h.c = pr
			h.mu.Unlock()
			return true
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 8*time.Second)
	}
	return false
}

// call runs one library call with its budget and reports it (start and
// end) to the supervisor, which checks it.
func (d *driverProc) call(ctx context.Context, host int, op, inst string, budget time.Duration, fn func(context.Context) error) error {
	return d.callExpect(ctx, host, op, inst, budget, nil, fn)
}

// callExpect is call where refused(err) marks a Permanent error the
// operation may return by design (EvictImage of a base in use): it is
// reported as class "Refused".
func (d *driverProc) callExpect(ctx context.Context, host int, op, inst string, budget time.Duration, refused func(error) bool, fn func(context.Context) error) error {
	id := d.ids.Add(1)
	d.emit(Event{Kind: EvCallStart, ID: id, Host: host, Op: op, Instance: inst, Budget: budget})
	cctx, cancel := context.WithTimeout(withDetail(ctx), budget)
	defer cancel()
	start := time.Now()
	err := fn(cctx)
	took := time.Since(start)
	class, text := "OK", ""
	if err != nil {
		class, text = errs.Code(err).String(), err.Error()
		switch {
		case ctx.Err() != nil && errors.Is(err, context.Canceled):
			class = "Canceled" // this driver is stopping
		case class == "Permanent" && refused != nil && refused(err):
			class = "Refused"
		}
	}
	d.emit(Event{Kind: EvCall, ID: id, Host: host, Op: op, Instance: inst, Result: class, Err: text, Latency: took, Budget: budget, Detail: detail(cctx)})
	return err
}

// reconcile is host h's model operator: List, delete what is not desired
// (orphans from List, tombstones from the supervisor), create what is
// missing, with the README's requeue policy.
func (d *driverProc) reconcile(ctx context.Context, h *dhost) {
	backoff := 500 * time.Millisecond
	for ctx.Err() == nil {
		clean := d.reconcileOnce(ctx, h)
		wait := time.Second
		if !clean {
			wait = backoff
			backoff = min(backoff*2, 8*time.Second)
		} else {
			backoff = 500 * time.Millisecond
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

func (d *driverProc) reconcileOnce(ctx context.Context, h *dhost) (clean bool) {
	c := h.client()
	var list []egressproxy.Instance
	if err := d.call(ctx, h.n, "list", "", budgetRead, func(cc context.Context) (err error) {
		list, err = c.List(cc)
		return err
	}); err != nil {
		return false
	}
	h.mu.Lock()
	h.listed = list
	h.mu.Unlock()
	desired, deleting := h.snapshot()
	clean = true
	blocked := map[string]bool{} // names whose old UID is not gone yet
	del := func(ref egressproxy.Ref) bool {
		err := d.call(ctx, h.n, "delete", ref.Name, budgetDelete, func(cc context.Context) error { return c.Delete(cc, ref) })
		switch errs.Code(err) {
		case errs.OK, errs.NotFound: // NotFound on delete: done
			return true
		}
		blocked[ref.Name] = true
		clean = false
		return false
	}
	seen := map[string]egressproxy.Instance{}
	for _, in := range list {
		if s, ok := desired[in.Name]; ok && s.UID == in.UID {
			seen[in.Name] = in
			continue
		}
		del(in.Ref) // an orphan, from List alone
	}
	// Tombstones: a deleted proxy whose Create may have been interrupted
	// before its domain was defined has volumes List cannot show; Delete
	// by name removes them. Not while the name is desired again (its
	// Create owns the name; List shows the old domain, if any).
	for name, ref := range deleting {
		if _, ok := desired[name]; ok {
			continue
		}
		if del(ref) {
			d.emit(Event{Kind: EvFinalized, Host: h.n, Instance: ref.Name, Detail: ref.UID})
		}
	}
	names := make([]string, 0, len(desired))
	for n := range desired {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		s := desired[n]
		if in, ok := seen[n]; (ok && up(in.State)) || blocked[n] {
			if blocked[n] {
				clean = false
			}
			continue
		}
		h.mu.Lock()
		_, isStuck := h.stuck[s.UID]
		h.mu.Unlock()
		if isStuck {
			continue // Permanent: stop and record; a new spec (UID) retries
		}
		err := d.call(ctx, h.n, "create", n, h.createBudget(), func(cc context.Context) error {
			_, err := c.Create(cc, s)
			return err
		})
		switch errs.Code(err) {
		case errs.OK:
		case errs.Permanent:
			h.mu.Lock()
			h.stuck[s.UID] = err.Error()
			h.mu.Unlock()
		default: // Transient, DeadlineExceeded: requeue with backoff
			clean = false
		}
	}
	return clean
}

// up reports whether an instance is up: the tiny image does not boot, so
// its domain runs without an address (Provisioning); Running would need a
// booting guest.
func up(s egressproxy.State) bool {
	return s == egressproxy.StateRunning || s == egressproxy.StateProvisioning
}

var upStates = []string{string(egressproxy.StateRunning), string(egressproxy.StateProvisioning)}

// inUse reports EvictImage's refusal of a base some domain uses.
func inUse(err error) bool {
	return strings.Contains(err.Error(), "is the backing store of domains") || strings.Contains(err.Error(), "refusing to evict base")
}

// sideLoad runs Gets, Checks, image listings, evictions and health rounds
// beside host h's reconciler.
func (d *driverProc) sideLoad(ctx context.Context, h *dhost, r *mrand.Rand) {
	c := h.client()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(500+r.IntN(1500)) * time.Millisecond):
		}
		switch x := r.IntN(12); {
		case x < 4:
			desired, _ := h.snapshot()
			if len(desired) == 0 {
				continue
			}
			names := make([]string, 0, len(desired))
			for n := range desired {
				names = append(names, n)
			}
			sort.Strings(names)
			s := desired[names[r.IntN(len(names))]]
			_ = d.call(ctx, h.n, "get", s.Name, budgetRead, func(cc context.Context) error {
				_, err := c.Get(cc, s.Ref())
				return err
			})
		case x < 7:
			_ = d.call(ctx, h.n, "check", "", budgetRead, func(cc context.Context) error {
				_, err := c.Check(cc)
				return err
			})
		case x < 8:
			_ = d.call(ctx, h.n, "list-images", "", budgetRead, func(cc context.Context) error {
				_, err := c.ListImages(cc)
				return err
			})
		case x < 10:
			// A health round over the instances of the last List (the
			// tiny image never gets an address: members without one keep
			// their state until the tracker's grace forgets them).
			h.mu.Lock()
			var members []health.Proxy
			for _, in := range h.listed {
				members = append(members, health.Proxy{ID: in.Name, Address: in.Address()})
			}
			h.mu.Unlock()
			target := d.cfg.ProbeTarget
			if h.guest != nil {
				target = h.guest.ProbeTarget
			}
			_ = d.call(ctx, h.n, "health-round", strconv.Itoa(len(members)), budgetRead, func(cc context.Context) error {
				res, err := h.tracker.Round(cc, members, &health.ProbeAllOptions{Target: target,
					Probe: health.ProbeOptions{Timeout: 5 * time.Second}})
				if err != nil {
					return err
				}
				healthy := 0
				for _, st := range h.tracker.Snapshot() {
					if st.Healthy() {
						healthy++
					}
				}
				var fails []string
				for _, r := range res {
					if !r.OK {
						fails = append(fails, fmt.Sprintf("%s: %s %d %v", r.ID, r.Kind, r.StatusCode, r.Err))
					}
				}
				det := fmt.Sprintf("probed %d healthy %d", len(res), healthy)
				if len(fails) > 0 {
					det += " (failed: " + strings.Join(fails, "; ") + ")"
				}
				setDetail(cc, det)
				return nil
			})
		default:
			// Evict an image no desired proxy of this host uses, so that
			// the next Create of it fetches it again (through the mirror's
			// faults); refused by design while a domain uses it (the
			// foreign owner's instance always uses "tiny").
			if h.guest != nil {
				continue // its one image is always in use
			}
			desired, _ := h.snapshot()
			key := d.cfg.Images[r.IntN(len(d.cfg.Images))]
			used := false
			for _, s := range desired {
				used = used || s.ImageKey == key
			}
			if used {
				continue
			}
			_ = d.callExpect(ctx, h.n, "evict-image", key, budgetRead, inUse, func(cc context.Context) error {
				return c.EvictImage(cc, key)
			})
		}
	}
}

func rss() int64 { return procRSS("self") }

// procRSS reads VmRSS of /proc/<pid>/status.
func procRSS(pid string) int64 {
	v, _ := procStatus(pid, "VmRSS:")
	return v
}

// procStatus reads a kB field of /proc/<pid>/status, in bytes.
func procStatus(pid, field string) (int64, bool) {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0, false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, true
		}
	}
	return 0, false
}

func settledSample() (int, int64) {
	runtime.GC()
	debug.FreeOSMemory()
	time.Sleep(200 * time.Millisecond)
	return runtime.NumGoroutine(), rss()
}

// A call may leave a detail for its EvCall (setDetail on its context).
type detailKey struct{}

func withDetail(ctx context.Context) context.Context {
	return context.WithValue(ctx, detailKey{}, new(string))
}

func setDetail(ctx context.Context, s string) {
	if p, ok := ctx.Value(detailKey{}).(*string); ok {
		*p = s
	}
}

func detail(ctx context.Context) string {
	if p, ok := ctx.Value(detailKey{}).(*string); ok {
		return *p
	}
	return ""
}
