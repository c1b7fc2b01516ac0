//go:build integration

package lab

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
)

// The budgets of the entry whose host is frozen, then cut off: a dead link
// is noticed after about keepalive×count, a redial to a stopped sshd or
// over a cut link gives up after the dial timeout, and no call without a
// deadline of its own outlives the call timeout.
const (
	frozenKeepalive   = 300 * time.Millisecond
	frozenKeepalives  = 3
	frozenDialTimeout = 2 * time.Second
	frozenCallTimeout = 5 * time.Second
	// healthyCheckBound is what a Check of a healthy entry may take while
	// another host is frozen or cut off (and its own host starts no
	// domain): generous for 2 busy cores, and well below the
	// keepalive×count the frozen entry's first call waits for.
	healthyCheckBound = 500 * time.Millisecond
)

// multiEntry is one provider entry on one lab host.
type multiEntry struct {
	host Host
	cfg  kvm2.Config
	p    *egressproxy.Client
	base string // its base volume of image "tiny"
}

func suffix(t *testing.T) string {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// entryConfig is host h's kvm2 Config for entry and owner over the direct
// link (not the delay proxy), with image "tiny" and a tiny machine type.
func entryConfig(h Host, entry, owner string, img imagecache.Image) kvm2.Config {
	cfg := hostConfig(h, h.SSHAddr)
	cfg.Entry, cfg.Owner = entry, owner
	cfg.Images = map[string]imagecache.Image{"tiny": img}
	cfg.MachineTypes = map[string]kvm2.MachineType{"tiny": {VCPUs: 1, MemoryMiB: 128}}
	return cfg
}

func openEntry(t *testing.T, cfg kvm2.Config) *egressproxy.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := kvm2.Open(ctx, cfg, &kvm2.Options{Logger: testr.New(t)})
	if err != nil {
		t.Fatalf("Open %s: %v", cfg.Entry, err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close %s: %v", cfg.Entry, err)
		}
	})
	return p
}

// ofEntry reports whether a libvirt domain or volume name belongs to entry
// (kvm2 and imagecache join the entry and what follows with "--").
func ofEntry(name, entry string) bool { return strings.Contains(name, entry+"--") }

// removeEntries destroys and undefines every domain and deletes every
// volume of the entries on host h: the net under the Deletes.
func removeEntries(h Host, entries ...string) error {
	mine := func(name string) bool {
		return slices.ContainsFunc(entries, func(e string) bool { return ofEntry(name, e) })
	}
	return h.Libvirt(func(l *libvirt.Libvirt) error {
		doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
		if err != nil {
			return err
		}
		for _, d := range doms {
			if mine(d.Name) {
				_ = l.DomainDestroy(d)
				_ = l.DomainUndefineFlags(d, libvirt.DomainUndefineManagedSave|libvirt.DomainUndefineSnapshotsMetadata|libvirt.DomainUndefineNvram)
			}
		}
		pool, err := l.StoragePoolLookupByName(h.Pool)
		if err != nil {
			return err
		}
		_ = l.StoragePoolRefresh(pool, 0)
		vols, _, err := l.StoragePoolListAllVolumes(pool, 1, 0)
		if err != nil {
			return err
		}
		for _, v := range vols {
			if mine(v.Name) {
				if err := l.StorageVolDelete(v, 0); err != nil {
					return fmt.Errorf("delete volume %s: %w", v.Name, err)
				}
			}
		}
		return nil
	})
}

// freezeSSHD stops host h's sshd and its sessions (teststack.FreezeSSHD)
// and returns the function that resumes them, which is also run at cleanup.
func freezeSSHD(t *testing.T, h Host) (thaw func()) {
	t.Helper()
	resume, frozen, err := teststack.FreezeSSHD(h.StackDir)
	if err != nil {
		t.Fatalf("host %d: %v", h.N, err)
	}
	t.Cleanup(resume)
	t.Logf("host %d: SIGSTOP sshd %d and its sessions %v", h.N, frozen[0], frozen[1:])
	return func() { resume(); t.Logf("host %d: SIGCONT %v", h.N, frozen) }
}

// timedCheck runs one Check with no deadline of its own (so the entry's
// CallTimeout bounds it) and returns its duration, health and error.
func timedCheck(p *egressproxy.Client) (time.Duration, egressproxy.Health, error) {
	start := time.Now()
	h, err := p.Check(context.Background())
	return time.Since(start), h, err
}

// TestLabMultiHost runs one provider entry per lab host, each over its own
// link: concurrent Creates on every host, List isolated by entry and by
// owner, base images per entry although every host's pool has the same
// name, and one host's sshd frozen, then its link cut, failing only that
// entry's calls, with the others unaffected, and the entry recovering on
// its own.
func TestLabMultiHost(t *testing.T) {
	env := Require(t)
	if len(env.Hosts) < 2 {
		t.Fatalf("lab has %d hosts, want at least 2", len(env.Hosts))
	}
	for _, h := range env.Hosts[1:] {
		if h.Pool != env.Hosts[0].Pool {
			t.Fatalf("host %d's pool %q differs from host 1's %q: the per-entry base test needs one pool name", h.N, h.Pool, env.Hosts[0].Pool)
		}
	}
	start := time.Now()
	sfx := suffix(t)
	url, sum := teststack.ServeTinyImage(t)
	img := imagecache.Image{URL: url, SHA256: sum}
	const owner, otherOwner = "lab-multi", "lab-multi-other"

	entries := make([]*multiEntry, len(env.Hosts))
	for i, h := range env.Hosts {
		e := &multiEntry{host: h, cfg: entryConfig(h, fmt.Sprintf("mh%s-%d", sfx, h.N), owner, img)}
		e.base = basecache.BaseName(e.cfg.Entry, "tiny", "qcow2")
		if i == 0 {
			// The entry whose host is frozen, then cut off: short budgets
			// so that its calls fail in bounded time.
			e.cfg.DialTimeout = frozenDialTimeout
			e.cfg.KeepaliveInterval = frozenKeepalive
			e.cfg.KeepaliveCount = frozenKeepalives
			e.cfg.CallTimeout = frozenCallTimeout
		}
		entries[i] = e
		// Registered before the provider opens, so it runs after its Close:
		// whatever the Deletes left, domains and volumes (bases included).
		t.Cleanup(func() {
			if err := removeEntries(h, e.cfg.Entry); err != nil {
				t.Errorf("cleanup host %d: %v", h.N, err)
			}
			if vols, err := h.PoolVolumes(); err != nil || slices.ContainsFunc(vols, func(v string) bool { return ofEntry(v, e.cfg.Entry) }) {
				t.Errorf("host %d: volumes of %s left after cleanup (%v): %v", h.N, e.cfg.Entry, err, vols)
			}
		})
		e.p = openEntry(t, e.cfg)
	}
	// A second owner on host 1, with the same entry name and pool.
	other := openEntry(t, entryConfig(env.Hosts[0], entries[0].cfg.Entry, otherOwner, img))

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	// Creates on every host at once: two instances per entry, cold base
	// fetch included.
	type created struct {
		e    *multiEntry
		spec egressproxy.Spec
		inst egressproxy.Instance
		err  error
		took time.Duration
	}
	var jobs []*created
	for _, e := range entries {
		for _, name := range []string{"px-a", "px-b"} {
			jobs = append(jobs, &created{e: e, spec: egressproxy.Spec{Name: name, UID: fmt.Sprintf("uid-%s-%s-%d", name, sfx, e.host.N), MachineType: "tiny"}})
		}
	}
	t.Cleanup(func() { // every instance at once, before the providers close
		c, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var wg sync.WaitGroup
		for _, j := range jobs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := j.e.p.Delete(c, j.spec.Ref()); err != nil {
					t.Errorf("Delete %s on host %d: %v", j.spec.Name, j.e.host.N, err)
				}
			}()
		}
		wg.Wait()
	})
	var wg sync.WaitGroup
	createStart := time.Now()
	for _, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := time.Now()
			j.inst, j.err = j.e.p.Create(ctx, j.spec)
			j.took = time.Since(s)
		}()
	}
	wg.Wait()
	t.Logf("MEASURE %d concurrent Creates on %d hosts: %v", len(jobs), len(entries), time.Since(createStart).Round(time.Millisecond))
	for _, j := range jobs {
		if j.err != nil {
			t.Fatalf("Create %s on host %d: %v", j.spec.Name, j.e.host.N, j.err)
		}
		t.Logf("Create %s on host %d: %v", j.spec.Name, j.e.host.N, j.took.Round(time.Millisecond))
		if j.inst.UID != j.spec.UID || j.inst.Name != j.spec.Name {
			t.Errorf("Create %s on host %d returned %+v", j.spec.Name, j.e.host.N, j.inst)
		}
	}
	// Every domain runs on its own host, and only there.
	for _, e := range entries {
		var running []string
		err := e.host.Libvirt(func(l *libvirt.Libvirt) error {
			doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive)
			for _, d := range doms {
				running = append(running, d.Name)
			}
			return err
		})
		if err != nil {
			t.Fatalf("host %d: list domains: %v", e.host.N, err)
		}
		for _, o := range entries {
			n := len(slices.DeleteFunc(slices.Clone(running), func(d string) bool { return !ofEntry(d, o.cfg.Entry) }))
			want := 0
			if o == e {
				want = 2
			}
			if n != want {
				t.Errorf("host %d runs %d domains of entry %s, want %d (running: %v)", e.host.N, n, o.cfg.Entry, want, running)
			}
		}
	}

	t.Run("list isolated by entry and owner", func(t *testing.T) {
		for _, e := range entries {
			list, err := e.p.List(ctx)
			if err != nil {
				t.Fatalf("List on host %d: %v", e.host.N, err)
			}
			var got, want []string
			for _, inst := range list {
				got = append(got, inst.Name+"/"+inst.UID)
			}
			for _, j := range jobs {
				if j.e == e {
					want = append(want, j.spec.Name+"/"+j.spec.UID)
				}
			}
			sort.Strings(got)
			sort.Strings(want)
			if !slices.Equal(got, want) {
				t.Errorf("List on host %d = %v, want exactly its own %v", e.host.N, got, want)
			}
		}
		// Another entry's instance is not found on this host.
		if _, err := entries[1].p.Get(ctx, jobs[0].spec.Ref()); errs.Code(err) != errs.NotFound {
			t.Errorf("Get of host 1's %s on host 2: %v, want NotFound", jobs[0].spec.Name, err)
		}
		// Another owner of the same entry on the same host sees nothing.
		list, err := other.List(ctx)
		if err != nil || len(list) != 0 {
			t.Errorf("List of owner %s on host 1 = %+v, %v; want nothing of owner %s", otherOwner, list, err, owner)
		}
		if _, err := other.Get(ctx, jobs[0].spec.Ref()); errs.Code(err) != errs.NotFound {
			t.Errorf("Get of owner %s's %s by owner %s: %v, want NotFound", owner, jobs[0].spec.Name, otherOwner, err)
		}
	})

	t.Run("base images per entry", func(t *testing.T) {
		for _, e := range entries {
			imgs, err := e.p.ListImages(ctx)
			if err != nil {
				t.Fatalf("ListImages on host %d: %v", e.host.N, err)
			}
			if len(imgs) != 1 || !imgs[0].Present || imgs[0].Name != e.base || len(imgs[0].InUseBy) != 2 {
				t.Errorf("ListImages on host %d = %+v, want %s present, used by 2", e.host.N, imgs, e.base)
			}
			vols, err := e.host.PoolVolumes()
			if err != nil {
				t.Fatalf("host %d: list pool %s: %v", e.host.N, e.host.Pool, err)
			}
			if !slices.Contains(vols, e.base) {
				t.Errorf("host %d's pool %s lacks its entry's base %s: %v", e.host.N, e.host.Pool, e.base, vols)
			}
			for _, o := range entries {
				if o != e && slices.ContainsFunc(vols, func(v string) bool { return ofEntry(v, o.cfg.Entry) }) {
					t.Errorf("host %d's pool %s holds volumes of host %d's entry %s: %v", e.host.N, e.host.Pool, o.host.N, o.cfg.Entry, vols)
				}
			}
		}
	})

	t.Run("one host frozen", func(t *testing.T) {
		oneHostFails(t, ctx, hostFault{name: "freeze", undo: "SIGCONT", inject: freezeSSHD}, entries[0], entries[1], jobs[0].spec, sfx)
	})
	t.Run("one host link down", func(t *testing.T) {
		oneHostFails(t, ctx, hostFault{name: "link down", undo: "link up", inject: func(t *testing.T, h Host) func() {
			return linkDown(t, env, h)
		}}, entries[0], entries[1], jobs[0].spec, sfx)
	})
	t.Logf("MEASURE TestLabMultiHost body: %v", time.Since(start).Round(time.Millisecond))
}

// hostFault takes a lab host away from the entries on it: inject does it
// and returns the function that undoes it (which it also registers with
// t.Cleanup, and which does nothing the second time).
type hostFault struct {
	name   string // what inject does, for messages: "freeze"
	undo   string // what the returned function does: "SIGCONT"
	inject func(t *testing.T, h Host) (restore func())
}

// linkDown cuts host h's link with `scripts/lab link N down` (the host's
// end goes down: every packet either way is lost and nobody is told, as
// with a pulled cable). It returns the function that brings it up again.
func linkDown(t *testing.T, env Env, h Host) (restore func()) {
	t.Helper()
	link := func(state string) error {
		cmd := exec.Command(env.Script, "link", strconv.Itoa(h.N), state)
		cmd.Env = append(os.Environ(), VarDir+"="+env.Dir)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s link %d %s: %v: %s", env.Script, h.N, state, err, out)
		}
		return nil
	}
	if err := link("down"); err != nil {
		t.Fatal(err)
	}
	t.Logf("host %d: link down", h.N)
	restored := false
	restore = func() {
		if restored {
			return
		}
		restored = true
		if err := link("up"); err != nil {
			t.Error(err)
		}
		t.Logf("host %d: link up", h.N)
	}
	t.Cleanup(restore)
	return restore
}

// oneHostFails applies fault to failing's host and checks that only that
// entry's calls fail, with the right class and within its budgets, while
// healthy's Checks, Create, Get and Delete go on at their usual speed; then
// undoes the fault and checks that failing recovers on its own. probe is an
// instance on failing's host, for the Gets.
func oneHostFails(t *testing.T, ctx context.Context, fault hostFault, failing, healthy *multiEntry, probe egressproxy.Spec, sfx string) {
	for _, e := range []*multiEntry{failing, healthy} {
		if took, h, err := timedCheck(e.p); err != nil || !h.Reachable {
			t.Fatalf("Check on host %d before the %s: %+v, %v", e.host.N, fault.name, h, err)
		} else {
			t.Logf("MEASURE Check on host %d before the %s: %v", e.host.N, fault.name, took.Round(time.Microsecond))
		}
	}
	restore := fault.inject(t, failing.host)
	faultAt := time.Now()

	// The failing entry's calls, while the healthy entry works.
	var (
		fHealth           egressproxy.Health
		fCheckErr         error
		fCheck, fGet      time.Duration
		fGetErr           error
		failingCheckEnded = make(chan struct{})
		failingCallsEnded = make(chan struct{})
	)
	go func() {
		defer close(failingCallsEnded)
		fCheck, fHealth, fCheckErr = timedCheck(failing.p)
		close(failingCheckEnded)
		s := time.Now()
		_, fGetErr = failing.p.Get(context.Background(), probe.Ref())
		fGet = time.Since(s)
	}()

	t.Cleanup(func() { <-failingCallsEnded }) // bounded by the entry's CallTimeout

	// The healthy entry, while the failing entry's Check waits for its
	// link: a Check every 100 ms. Nothing else runs on the healthy host
	// meanwhile, because a Check counts the running instances and that
	// listing waits for a domain the host is starting (kvm2.Check's doc).
	var (
		worst     time.Duration
		checks    int
		checkErrs []string
	)
	for done := false; !done; {
		took, h, err := timedCheck(healthy.p)
		checks++
		worst = max(worst, took)
		if err != nil || !h.Reachable {
			checkErrs = append(checkErrs, fmt.Sprintf("%+v, %v", h, err))
		}
		select {
		case <-failingCheckEnded:
			done = true
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Logf("MEASURE %d Checks on healthy host %d during host %d's Check after the %s: worst %v", checks, healthy.host.N, failing.host.N, fault.name, worst.Round(time.Microsecond))
	if len(checkErrs) > 0 {
		t.Errorf("Checks on healthy host %d during the %s failed: %v", healthy.host.N, fault.name, checkErrs)
	}
	if checks < 3 || worst > healthyCheckBound {
		t.Errorf("%d Checks on healthy host %d during host %d's %s, the worst took %v; want >= 3, each < %v", checks, healthy.host.N, failing.host.N, fault.name, worst, healthyCheckBound)
	}

	// Then a Create, Get and Delete on the healthy host, while the failing
	// entry's Get still waits for its redial.
	tag := strings.ReplaceAll(fault.name, " ", "-")
	spec := egressproxy.Spec{Name: "px-during-" + tag, UID: "uid-during-" + tag + "-" + sfx, MachineType: "tiny"}
	s := time.Now()
	if _, err := healthy.p.Create(ctx, spec); err != nil {
		t.Errorf("Create on healthy host %d during the %s: %v", healthy.host.N, fault.name, err)
	}
	if got, err := healthy.p.Get(ctx, spec.Ref()); err != nil || got.UID != spec.UID {
		t.Errorf("Get on healthy host %d during the %s: %+v, %v", healthy.host.N, fault.name, got, err)
	}
	if err := healthy.p.Delete(ctx, spec.Ref()); err != nil {
		t.Errorf("Delete on healthy host %d during the %s: %v", healthy.host.N, fault.name, err)
	}
	t.Logf("MEASURE Create+Get+Delete on healthy host %d during the %s: %v", healthy.host.N, fault.name, time.Since(s).Round(time.Millisecond))
	<-failingCallsEnded

	t.Logf("MEASURE host %d after %s: Check %v → %+v, %v; Get %v → %v", failing.host.N, fault.name, fCheck.Round(time.Millisecond), fHealth, fCheckErr, fGet.Round(time.Millisecond), fGetErr)
	// The first call waits for keepalive to declare the link dead, a
	// redial for its timeout; nothing outlives the call timeout.
	bound := frozenCallTimeout + 2*time.Second
	if fCheckErr != nil || fHealth.Reachable || fHealth.Reason != egressproxy.ReasonUnreachable {
		t.Errorf("Check on host %d after %s: %+v, %v; want not Reachable, reason %s, no error", failing.host.N, fault.name, fHealth, fCheckErr, egressproxy.ReasonUnreachable)
	}
	if fCheck > bound {
		t.Errorf("Check on host %d after %s took %v, want <= %v", failing.host.N, fault.name, fCheck, bound)
	}
	if errs.Code(fGetErr) != errs.Transient {
		t.Errorf("Get on host %d after %s: %v (code %v), want Transient", failing.host.N, fault.name, fGetErr, errs.Code(fGetErr))
	}
	if fGet > bound {
		t.Errorf("Get on host %d after %s took %v, want <= %v", failing.host.N, fault.name, fGet, bound)
	}
	// The failing entry's Check must have waited for its link to be
	// declared dead: the healthy Checks above ran while it waited.
	if fCheck < healthyCheckBound {
		t.Errorf("host %d's Check after %s took %v; want it to wait for the dead link (>= %v), so that the healthy Checks ran meanwhile", failing.host.N, fault.name, fCheck, healthyCheckBound)
	}

	restore()
	restoredAt := time.Now()
	t.Logf("host %d: %s for %v", failing.host.N, fault.name, restoredAt.Sub(faultAt).Round(time.Millisecond))
	// The failing entry recovers on its own: each Check is bounded by its
	// CallTimeout; a few may still meet the stale state.
	var h egressproxy.Health
	for tries := 0; ; tries++ {
		var err error
		_, h, err = timedCheck(failing.p)
		if err == nil && h.Reachable {
			break
		}
		if tries == 4 || time.Since(restoredAt) > 30*time.Second {
			t.Fatalf("Check on host %d after %s still %+v, %v", failing.host.N, fault.undo, h, err)
		}
	}
	t.Logf("MEASURE host %d reachable again %v after %s", failing.host.N, time.Since(restoredAt).Round(time.Millisecond), fault.undo)
	if got, err := failing.p.Get(ctx, probe.Ref()); err != nil || got.UID != probe.UID {
		t.Errorf("Get on host %d after %s: %+v, %v", failing.host.N, fault.undo, got, err)
	}
}
