//go:build integration

package operator_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
	"github.com/egressproxy/egressproxy/internal/testing/lab"
	"github.com/egressproxy/egressproxy/kvm2"
)

// labScript runs scripts/lab with args on env's lab.
func labScript(env lab.Env, args ...string) error {
	cmd := exec.Command(env.Script, args...)
	cmd.Env = append(os.Environ(), lab.VarDir+"="+env.Dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %v: %s", env.Script, strings.Join(args, " "), err, out)
	}
	return nil
}

// TestPoolOnLab: a pool of 2 booting guests on kvm2 entries, one per lab
// host, in this process's operator controllers on the real control plane.
// Host 1's link is cut (scripts/lab link 1 down: its proxy silent and its
// entry unreachable): the slices stop listing host 1's proxy, a
// replacement boots on host 2 after the grace and is Healthy, and the
// slices list only host 2's two; the lost child waits in its finalizer
// (its VM cannot be deleted) and counts for nothing. The link restored,
// the finalizer deletes the old VM on host 1, and the pool surges back to
// one per host, never listing fewer than 2 ready on the way. Four guest
// boots in all: the two of the pool, the replacement, the one that
// restores the spread. It logs each phase's time (docs/fleet.md).
func TestPoolOnLab(t *testing.T) {
	env := lab.Require(t)
	if len(env.Hosts) < 2 {
		if lab.InCI() {
			t.Fatalf("CI=true: the lab has %d host(s), the pool needs 2 (onstack --lab 2)", len(env.Hosts))
		}
		t.Skipf("the lab has %d host(s), the pool needs 2", len(env.Hosts))
	}
	g := bootingGuest(t) // under CI=true a missing guest image fails
	if g == nil {
		t.Skip("no booting guest: the pool's proxies must pass real CONNECT probes")
	}
	hosts := e2eHosts(t)
	ctx := context.Background()

	// The probes' target is on host 1's caller address; host 2's guests
	// reach it through the caller (a host has no route beyond its link),
	// so that one target serves both hosts' proxies, also while host 1's
	// link is down (the address stays the caller's).
	via := env.Hosts[1].CallerAddr
	route := []string{"exec", "2", "ip", "route", "replace", g.targetIP + "/32", "via", via}
	if err := labScript(env, route...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := labScript(env, "exec", "2", "ip", "route", "del", g.targetIP+"/32", "via", via); err != nil {
			t.Error(err)
		}
	})
	target := guesttest.ServeTarget(t, g.targetIP)
	g.target = target.Addr

	sfx := suffix(t)
	const own = "ep-pool-lab"
	names := []string{"pol" + sfx + "a", "pol" + sfx + "b"}
	img := imagecache.Image{URL: guesttest.ServeFile(t, "/guest.qcow2", g.image).URL + "/guest.qcow2", SHA256: g.sha256, Format: "qcow2"}
	entries := map[string]*egressproxy.Client{}
	side := map[string]*egressproxy.Client{}
	consoles := map[string]string{}
	for i, h := range hosts {
		cfg := entryConfig(h, names[i], own, imagecache.Image{})
		cfg.Images = map[string]imagecache.Image{"guest": img}
		cfg.MachineTypes = map[string]kvm2.MachineType{"small": {VCPUs: 1, MemoryMiB: 512}}
		cfg.Kernel, cfg.Initrd, cfg.Cmdline = g.kernel, g.initrd, g.cmdline
		cfg.ConsoleLogDir = t.TempDir()
		consoles[names[i]] = cfg.ConsoleLogDir
		// A dead link is found by the keepalives within seconds (then
		// each Check fails its dial within DialTimeout): the entry reads
		// Unreachable long before the grace ends.
		cfg.KeepaliveInterval, cfg.KeepaliveCount = time.Second, 3
		cfg.DialTimeout = 5 * time.Second
		side[names[i]] = sideProvider(t, h, cfg)
		cfg.KeyFile, cfg.KnownHostsFile = h.keyFile, h.knownHosts
		p, err := kvm2.Open(ctx, cfg, &kvm2.Options{Logger: testr.NewWithOptions(t, testr.Options{Verbosity: 0}).WithName(names[i])})
		if err != nil {
			t.Fatalf("open %s: %v", names[i], err)
		}
		entries[names[i]] = p
	}
	// A probe through a guest under TCG on a loaded machine takes up to
	// a few seconds.
	const probeTimeout = 5 * time.Second
	pe := startPoolEnvWith(t, poolEnvOptions{entries: entries, target: target.Addr, probeTimeout: probeTimeout})

	// The grace must outlast a guest's time from its address to Squid
	// answering (about 10-15 s, more on a loaded machine): the grace of
	// a child that never was Healthy runs from its address.
	const grace = 30 * time.Second
	pool := pe.createPool(t, "lab", 2, grace, func(p *v1alpha1.EgressProxyPool) {
		p.Spec.Template.Image, p.Spec.Template.MachineType, p.Spec.Template.Port = "guest", "small", 3128
	})
	key := client.ObjectKeyFromObject(pool)
	// Every child ever, by UID: a name freed by a deleted child is the
	// next child's (the lowest free index).
	seen := map[types.UID]v1alpha1.EgressProxy{}
	note := func() []v1alpha1.EgressProxy {
		var l v1alpha1.EgressProxyList
		if err := pe.c.List(ctx, &l, client.InNamespace(pe.ns), client.MatchingLabels{controller.LabelPool: key.Name}); err != nil {
			t.Logf("list children: %v", err)
			return nil
		}
		for _, k := range l.Items {
			if _, ok := seen[k.UID]; !ok {
				seen[k.UID] = k
			}
		}
		return l.Items
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, k := range seen {
				t.Logf("the console of %s on %s:\n%s", k.Name, k.Spec.Provider,
					guesttest.ConsoleLog(consoles[k.Spec.Provider], "ep-"+k.Spec.Provider+"--"+controller.InstanceName(client.ObjectKeyFromObject(&k))))
			}
		}
	})

	t0 := time.Now()
	var kids []v1alpha1.EgressProxy
	waitFor(t, 12*time.Minute, "a pool of 2, one per host, both Healthy and listed", func() string {
		note()
		var msg string
		kids, msg = poolState(ctx, pe.c, key, 2, map[string]int{names[0]: 1, names[1]: 1})
		return msg
	})
	t.Logf("2 guests booted and Healthy, one per host, %v after the pool's create (cold image on both hosts)", time.Since(t0).Round(100*time.Millisecond))
	var old v1alpha1.EgressProxy
	for _, k := range kids {
		if k.Spec.Provider == names[0] {
			old = k
		}
	}
	oldListed := listedForm(t, old.Status.Address)
	oldRef := egressproxy.Ref{Name: controller.InstanceName(client.ObjectKeyFromObject(&old)), UID: string(old.UID)}
	stopWatch := watchSlices(pe.c, key)

	// Host 1's link cut.
	if err := labScript(env, "link", "1", "down"); err != nil {
		t.Fatal(err)
	}
	tCut := time.Now()
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := labScript(env, "link", "1", "up"); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(restore)

	// What happens, each at the first poll (every 250 ms) that sees it.
	var tUnreachable, tCreated, tVM, tAddress, tHealthy, tOldDeleting, tDone time.Time
	var repl *v1alpha1.EgressProxy
	at := func(p *time.Time, ok bool) {
		if ok && p.IsZero() {
			*p = time.Now()
		}
	}
	if !eventually.PollEvery(ctx, 10*time.Minute, 250*time.Millisecond, func() bool {
		at(&tUnreachable, hostReady(ctx, pe.c, names[0]) != "")
		for _, k := range note() {
			switch {
			case k.UID == old.UID:
				at(&tOldDeleting, !k.DeletionTimestamp.IsZero())
			case k.Spec.Provider == names[1] && k.UID != kids[0].UID && k.UID != kids[1].UID:
				if repl == nil {
					repl = k.DeepCopy()
					at(&tCreated, true)
				}
				at(&tAddress, k.Status.Address != "")
				at(&tHealthy, k.Status.Health == v1alpha1.HealthHealthy)
			}
		}
		if repl != nil && tVM.IsZero() {
			_, err := side[names[1]].Get(ctx, egressproxy.Ref{Name: controller.InstanceName(client.ObjectKeyFromObject(repl)), UID: string(repl.UID)})
			at(&tVM, err == nil)
		}
		_, msg := poolState(ctx, pe.c, key, 2, map[string]int{names[1]: 2})
		at(&tDone, msg == "")
		return !tDone.IsZero()
	}) {
		_, msg := poolState(ctx, pe.c, key, 2, map[string]int{names[1]: 2})
		t.Fatalf("not within 10 min of the cut: 2 Healthy on host 2 and listed: %s", msg)
	}
	if repl == nil || tVM.IsZero() || tHealthy.IsZero() {
		t.Fatalf("healed without a replacement seen: %+v", repl)
	}
	// The lost child waits in its finalizer (its VM on the cut host
	// cannot be deleted) and is neither counted nor listed.
	var lost v1alpha1.EgressProxy
	if err := pe.c.Get(ctx, client.ObjectKeyFromObject(&old), &lost); err != nil || lost.UID != old.UID || lost.DeletionTimestamp.IsZero() {
		t.Errorf("the lost child while host 1 is cut: %v, deletionTimestamp %v; want it kept by its finalizer", err, lost.DeletionTimestamp)
	}
	var stored v1alpha1.EgressProxyPool
	if err := pe.c.Get(ctx, key, &stored); err != nil {
		t.Fatal(err)
	}
	t.Logf("after the cut, pool status: created %d, healthy %d, entries %+v", stored.Status.CreatedReplicas, stored.Status.HealthyReplicas, stored.Status.Entries)

	// The link restored.
	restore()
	tUp := time.Now()
	var tOldGone, tSpread time.Time
	if !eventually.PollEvery(ctx, 10*time.Minute, 250*time.Millisecond, func() bool {
		note()
		if tOldGone.IsZero() {
			var now v1alpha1.EgressProxy
			err := pe.c.Get(ctx, client.ObjectKeyFromObject(&old), &now)
			if apierrors.IsNotFound(err) || (err == nil && now.UID != old.UID) {
				if _, err := side[names[0]].Get(ctx, oldRef); egressproxy.Code(err) == egressproxy.NotFound {
					at(&tOldGone, true)
				}
			}
		}
		if _, msg := poolState(ctx, pe.c, key, 2, map[string]int{names[0]: 1, names[1]: 1}); msg != "" {
			return false
		}
		var l v1alpha1.EgressProxyList
		if err := pe.c.List(ctx, &l, client.InNamespace(pe.ns)); err != nil || len(l.Items) != 2 {
			return false
		}
		n, err := pe.instances(ctx)
		if err != nil || !maps.Equal(n, map[string]int{names[0]: 1, names[1]: 1}) {
			return false
		}
		at(&tSpread, true)
		return !tOldGone.IsZero()
	}) {
		n, err := pe.instances(ctx)
		_, msg := poolState(ctx, pe.c, key, 2, map[string]int{names[0]: 1, names[1]: 1})
		t.Fatalf("not within 10 min of the restore: the old VM deleted (%v) and one Healthy per host: %s; instances %v (%v)", !tOldGone.IsZero(), msg, n, err)
	}
	samples := stopWatch()

	// The slices: host 1's proxy gone within the tracker's fall after
	// the cut: 3 failed probes, each of a round that waits out its probe
	// timeout (a cut link drops the packets: no refusal ends a probe
	// early) and the interval; never fewer than 2 ready once the
	// replacement was listed, through the restore's surge.
	const fall = 3 // health.TrackerOptions.Fall's default
	allowed := fall*(probeTimeout+pe.interval) + 2*time.Second
	var tUnlisted time.Time
	minReady := -1
	for _, s := range samples {
		if s.at.After(tCut) && tUnlisted.IsZero() && !slices.Contains(s.listed, oldListed) {
			tUnlisted = s.at
		}
		if s.at.After(tDone) && (minReady < 0 || len(s.ready) < minReady) {
			minReady = len(s.ready)
		}
	}
	if tUnlisted.IsZero() {
		t.Errorf("the slices listed host 1's proxy %s until the end", oldListed)
	} else if d := tUnlisted.Sub(tCut); d > allowed {
		t.Errorf("host 1's proxy was listed %v after the cut, want within %v (fall %d × (probe timeout %v + interval %v) and a reconcile)", d.Round(100*time.Millisecond), allowed, fall, probeTimeout, pe.interval)
	}
	if minReady < 2 {
		t.Errorf("after the replacement was Healthy the slices listed as few as %d ready, want at least 2", minReady)
	}
	if len(seen) != 4 {
		var all []string
		for _, k := range seen {
			all = append(all, k.Name+" on "+k.Spec.Provider)
		}
		slices.Sort(all)
		t.Errorf("%d children (guest boots) in all: %v; want 4 (2, the replacement, the one that restores the spread)", len(seen), all)
	}
	r := func(a, b time.Time) string { return b.Sub(a).Round(100 * time.Millisecond).String() }
	t.Logf("cut -> host 1's proxy unlisted %s (allowed %v); cut -> entry %s Unreachable %s", r(tCut, tUnlisted), allowed, names[0], r(tCut, tUnreachable))
	t.Logf("cut -> replacement created %s (grace %v), created -> VM defined on host 2 %s, VM -> address (boot to lease) %s, address -> Healthy (Squid and the tracker's rise) %s, Healthy -> 2 Healthy and listed %s; cut -> full Healthy %s",
		r(tCut, tCreated), grace, r(tCreated, tVM), r(tVM, tAddress), r(tAddress, tHealthy), r(tHealthy, tDone), r(tCut, tDone))
	t.Logf("cut -> lost child deleted (its finalizer waiting for host 1) %s", r(tCut, tOldDeleting))
	t.Logf("link up -> old VM on host 1 deleted by its finalizer %s; link up -> spread 1/1 again, all Healthy %s", r(tUp, tOldGone), r(tUp, tSpread))
	t.Logf("%d slice samples; at least %d ready after the replacement; %d guest boots", len(samples), minReady, len(seen))
	pe.deletePool(t, pool)
	t.Logf("TestPoolOnLab in %v", time.Since(t0).Round(time.Second))
}
