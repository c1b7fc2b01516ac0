package kvm2

import (
	"context"
	"strconv"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
)

// Check's Capacity: the node's CPUs, its free memory with buffers and
// page cache, the owner's domains that run (not a stopped one, not
// another owner's, not another entry's) and the pool's free space.
func TestFakeCheckCapacity(t *testing.T) {
	ctx := context.Background()
	e := newFakeEnv(t)
	e.host.SetNode(libvirtfake.Node{CPUs: 12, TotalKiB: 64 << 20, FreeKiB: 10 << 20, BuffersKiB: 1 << 20, CachedKiB: 5 << 20})
	e.mustCreate("a")
	e.mustCreate("b")
	e.mustCreate("c")
	if !e.host.UpdateDomain(e.dom("c"), func(d *libvirtfake.Domain) { d.State, d.ID = libvirt.DomainShutoff, -1 }) {
		t.Fatal("no domain c")
	}
	for _, x := range []string{
		foreignXML(t, e.dom("o"), e.cfg.Entry, "another-owner", false),
		foreignXML(t, domainName("lab-2", "x"), "lab-2", e.cfg.Owner, false),
	} {
		d, err := e.host.DefineDomain(x)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.host.StartDomain(d.Name); err != nil {
			t.Fatal(err)
		}
	}
	h, err := e.p.Check(ctx)
	if err != nil || !h.Reachable || h.Capacity == nil {
		t.Fatalf("Check = %+v, %v; want Reachable with a Capacity", h, err)
	}
	want := egressproxy.Capacity{CPUs: 12, MemoryAvailableBytes: 16 << 30, Instances: 2, PoolAvailableBytes: h.Capacity.PoolAvailableBytes}
	if *h.Capacity != want {
		t.Errorf("Capacity %+v, want %+v", *h.Capacity, want)
	}
	if got := formatGiB(uint64(h.Capacity.PoolAvailableBytes)); got != h.Details["poolFreeGiB"] || h.Capacity.PoolAvailableBytes <= 0 {
		t.Errorf("PoolAvailableBytes %d (%s GiB), want the pool's free space, poolFreeGiB %s", h.Capacity.PoolAvailableBytes, got, h.Details["poolFreeGiB"])
	}
	if _, ok := h.Details[detailCapacity]; ok {
		t.Errorf("a %s detail on a Check that read the capacity: %v", detailCapacity, h.Details)
	}
}

// When libvirtd refuses a node call the entry is still Reachable, without
// a Capacity, with a capacity detail saying why; a link that dies during
// those calls makes the entry Unreachable as at any other step.
func TestFakeCheckCapacityRefused(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		method string
		err    error
		reason egressproxy.HealthReason // ReasonNone: Reachable without a Capacity
	}{
		{"NodeGetInfo", libvirtfake.Errorf(libvirt.ErrAccessDenied, "access denied: 'node' read"), egressproxy.ReasonNone},
		{"NodeGetMemoryStats", libvirtfake.Errorf(libvirt.ErrNoSupport, "this function is not supported by the connection driver"), egressproxy.ReasonNone},
		{"NodeGetMemoryStats", libvirt.ErrUnsupported, egressproxy.ReasonNone},
		{"NodeGetInfo", libvirt.ErrInterrupted, egressproxy.ReasonUnreachable},
		{"ConnectGetAllDomainStats", libvirtfake.Errorf(libvirt.ErrRPC, "rpc failed"), egressproxy.ReasonUnreachable},
	} {
		t.Run(tc.method+" "+tc.err.Error(), func(t *testing.T) {
			e := newFakeEnv(t)
			e.host.SetHook(tc.method, libvirtfake.Fail(tc.err))
			h, err := e.p.Check(ctx)
			if err != nil {
				t.Fatalf("Check: %v", err)
			}
			if h.Capacity != nil {
				t.Errorf("Capacity %+v after a failed %s", *h.Capacity, tc.method)
			}
			if tc.reason == egressproxy.ReasonNone {
				if !h.Reachable || h.Details[detailCapacity] == "" {
					t.Errorf("Check = %+v; want Reachable with a %s detail", h, detailCapacity)
				}
				return
			}
			if h.Reachable || h.Reason != tc.reason {
				t.Errorf("Check = %+v; want reason %s", h, tc.reason)
			}
		})
	}
}

// The entry's client, on the fake: every operation's duration and the
// last Check's facts carry the entry; the facts follow the host and end
// with Close.
func TestFakeMetricsOfTheEntry(t *testing.T) {
	ctx := context.Background()
	e := newFakeEnv(t)
	rd := metrictest.New(t)
	c := driver.NewClient(e.p, clientOptions(e.cfg, &Options{MeterProvider: rd.MeterProvider()}))
	if _, err := c.Create(ctx, fakeSpec("a")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, egressproxy.Ref{Name: "nope", UID: "u"}); egressproxy.Code(err) != egressproxy.NotFound {
		t.Fatalf("Get of a missing instance: %v", err)
	}
	h, err := c.Check(ctx)
	if err != nil || h.Capacity == nil {
		t.Fatalf("Check = %+v, %v", h, err)
	}
	entry := map[string]string{"egressproxy.entry": e.cfg.Entry}
	op := func(name, errType string) string {
		a := map[string]string{"egressproxy.entry": e.cfg.Entry, "egressproxy.operation": name}
		if errType != "" {
			a["error.type"] = errType
		}
		return metrictest.Key(obs.MetricClientOperationDuration, a)
	}
	got := map[string]string{}
	for _, s := range rd.Collect(t) {
		got[s.Key()] = s.Text()
	}
	want := map[string]string{
		op("create", ""):      "count 1",
		op("get", "NotFound"): "count 1",
		op("check", ""):       "count 1",
		metrictest.Key(obs.MetricEntryReachable, entry):       "1",
		metrictest.Key(obs.MetricEntryCPUCount, entry):        "8",
		metrictest.Key(obs.MetricEntryMemoryAvailable, entry): strconv.FormatInt(24<<30, 10),
		metrictest.Key(obs.MetricEntryInstanceCount, entry):   "1",
		metrictest.Key(obs.MetricEntryPoolAvailable, entry):   strconv.FormatInt(h.Capacity.PoolAvailableBytes, 10),
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("series (-want +got):\n%s", d)
	}

	// The host goes away: the next Check reports it unreachable, and the
	// capacity's series end.
	e.host.SetHook("Do", libvirtfake.Fail(libvirt.ErrInterrupted))
	if h, err := c.Check(ctx); err != nil || h.Reachable {
		t.Fatalf("Check of a host gone = %+v, %v", h, err)
	}
	var facts []string
	for _, s := range rd.Collect(t) {
		if s.Kind != metrictest.Histogram {
			facts = append(facts, s.Key()+" "+strconv.FormatFloat(s.Value, 'f', -1, 64))
		}
	}
	if d := cmp.Diff([]string{metrictest.Key(obs.MetricEntryReachable, entry) + " 0"}, facts); d != "" {
		t.Errorf("facts of an unreachable entry (-want +got):\n%s", d)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	for _, s := range rd.Collect(t) {
		if s.Kind != metrictest.Histogram {
			t.Errorf("series %s after Close", s.Key())
		}
	}
}
