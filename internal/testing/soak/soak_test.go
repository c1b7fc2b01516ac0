package soak

import (
	"bytes"
	"encoding/json"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func params(seed uint64) Params { return DefaultParams(seed, 5*time.Minute, 3) }

func TestScheduleSameSeedSameSchedule(t *testing.T) {
	a, err := NewSchedule(params(42))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := NewSchedule(params(42))
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("seed 42 gave two schedules:\n%v\n%v", a, b)
	}
	c, _ := NewSchedule(params(43))
	if reflect.DeepEqual(a, c) {
		t.Fatal("seeds 42 and 43 gave the same schedule")
	}
}

func TestScheduleFaultParamsLeaveOpsAlone(t *testing.T) {
	p := params(7)
	a, _ := NewSchedule(p)
	p.FaultEvery = 5 * time.Second
	p.Faults = []Kind{FaultLinkDown}
	b, _ := NewSchedule(p)
	ops := func(s []Step) (out []Step) {
		for _, x := range s {
			if !x.Kind.IsFault() {
				out = append(out, x)
			}
		}
		return out
	}
	if !reflect.DeepEqual(ops(a), ops(b)) {
		t.Fatal("changing the fault parameters changed the operations")
	}
	for _, s := range b {
		if s.Kind.IsFault() && s.Kind != FaultLinkDown {
			t.Fatalf("fault %v outside Faults", s)
		}
	}
}

// TestScheduleShape checks what the driver relies on, over many seeds.
func TestScheduleShape(t *testing.T) {
	for seed := range uint64(200) {
		p := params(seed)
		s, err := NewSchedule(p)
		if err != nil {
			t.Fatal(err)
		}
		live := map[int]int{} // slot -> gen
		var lastFaultEnd time.Duration
		faults := 0
		for i, x := range s {
			if i > 0 && x.At < s[i-1].At {
				t.Fatalf("seed %d: step %d (%v) before step %d (%v)", seed, i, x, i-1, s[i-1])
			}
			if x.At >= p.Duration-p.Quiet {
				t.Fatalf("seed %d: step %v in the quiet period", seed, x)
			}
			if x.Kind.IsFault() {
				faults++
				if x.At < lastFaultEnd {
					t.Fatalf("seed %d: fault %v overlaps the previous one (ends %v)", seed, x, lastFaultEnd)
				}
				if x.At+x.Dur >= p.Duration-p.Quiet {
					t.Fatalf("seed %d: fault %v ends in the quiet period", seed, x)
				}
				if x.Kind.HostFault() != (x.Host >= 1 && x.Host <= p.Hosts) {
					t.Fatalf("seed %d: fault %v has host %d", seed, x, x.Host)
				}
				lastFaultEnd = x.At + x.Dur
				continue
			}
			if x.Host != x.Slot%p.Hosts+1 {
				t.Fatalf("seed %d: %v on host %d, want slot's host %d", seed, x, x.Host, x.Slot%p.Hosts+1)
			}
			g, ok := live[x.Slot]
			switch x.Kind {
			case OpCreate:
				if ok {
					t.Fatalf("seed %d: %v creates a live slot", seed, x)
				}
				live[x.Slot] = x.Gen
			case OpDelete:
				if !ok || g != x.Gen {
					t.Fatalf("seed %d: %v deletes a slot not live at that gen (%d, %v)", seed, x, g, ok)
				}
				delete(live, x.Slot)
			case OpSpec, OpImage:
				if !ok || x.Gen != g+1 {
					t.Fatalf("seed %d: %v changes slot at gen %d (live %v)", seed, x, g, ok)
				}
				live[x.Slot] = x.Gen
			}
			if x.At > 0 && (len(live) < p.MinProxies || len(live) > p.MaxProxies) {
				t.Fatalf("seed %d: after %v %d proxies desired, want %d..%d", seed, x, len(live), p.MinProxies, p.MaxProxies)
			}
		}
		if faults == 0 {
			t.Errorf("seed %d: no fault in 5 minutes", seed)
		}
	}
}

func TestParamsValidate(t *testing.T) {
	p := params(1)
	p.Quiet = p.Duration
	if _, err := NewSchedule(p); err == nil {
		t.Error("a quiet period as long as the run was accepted")
	}
	p = params(1)
	p.Images = nil
	if _, err := NewSchedule(p); err == nil {
		t.Error("no images accepted")
	}
	if s, err := ParseSeed("123"); err != nil || s != 123 {
		t.Errorf("ParseSeed(123) = %d, %v", s, err)
	}
	if _, err := ParseSeed("x"); err == nil {
		t.Error("ParseSeed(x) accepted")
	}
}

// TestReplay runs a schedule twice through a fake executor that logs each
// step the way the driver does: the event logs, read back from their JSON
// lines, give the same step sequence, and a schedule survives its JSON.
func TestReplay(t *testing.T) {
	run := func(seed uint64) []Event {
		s, _ := NewSchedule(params(seed))
		var buf bytes.Buffer
		clock := time.Unix(0, 0).UTC()
		l := NewLog(&buf, func() time.Time { clock = clock.Add(time.Millisecond); return clock })
		l.Add(Event{Kind: EvNote, Detail: "seed"})
		for _, x := range s {
			l.Add(Event{Kind: EvStep, Op: string(x.Kind), Host: x.Host, Detail: StepDetail(x)})
			l.Add(Event{Kind: EvCall, Op: "list", Host: x.Host, Result: "OK", Latency: time.Duration(len(buf.Bytes()))})
		}
		if err := l.Flush(); err != nil {
			t.Fatal(err)
		}
		back, err := ReadEvents(&buf)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(back, l.Events()) {
			t.Fatal("the event log read back differs from the one written")
		}
		return back
	}
	a, b := StepEvents(run(99)), StepEvents(run(99))
	if len(a) == 0 || !reflect.DeepEqual(a, b) {
		t.Fatalf("replay of seed 99 differs (%d vs %d steps)", len(a), len(b))
	}
	if reflect.DeepEqual(a, StepEvents(run(100))) {
		t.Fatal("seeds 99 and 100 logged the same steps")
	}
	s, _ := NewSchedule(params(5))
	js, _ := json.Marshal(s)
	var back []Step
	if err := json.Unmarshal(js, &back); err != nil || !reflect.DeepEqual(back, s) {
		t.Fatalf("schedule JSON round trip: %v", err)
	}
}

func TestCheckerSecret(t *testing.T) {
	l := NewLog(nil, nil)
	c := NewChecker(l, "hunter2-secret", "")
	var got []Violation
	c.OnViolation = func(v Violation) { got = append(got, v) }
	if !c.CheckText("log", "fetch http://user:xxxxx@127.0.0.1/tiny.qcow2 failed") {
		t.Error("a redacted URL counted as a secret")
	}
	if c.CheckText("err", "fetch http://user:hunter2-secret@127.0.0.1/") {
		t.Error("a planted secret was not found")
	}
	if len(got) != 1 || strings.Contains(got[0].Detail, "hunter2") {
		t.Fatalf("violations %v: want one that does not repeat the secret", got)
	}
	if n := c.Checks()[InvSecret]; n != 2 {
		t.Errorf("%d secret checks counted, want 2", n)
	}
	if ev := l.Last(1); len(ev) != 1 || ev[0].Kind != EvViolation {
		t.Errorf("violation not logged: %v", ev)
	}
}

func TestCheckerBudgetAndClass(t *testing.T) {
	c := NewChecker(nil)
	if !c.CheckBudget("get", "px", 31*time.Second, 30*time.Second, 5*time.Second) {
		t.Error("a call within its grace counted as a violation")
	}
	if c.CheckBudget("get", "px", 36*time.Second, 30*time.Second, 5*time.Second) {
		t.Error("a call beyond budget+grace passed")
	}
	for _, cl := range []string{"OK", "Transient", "NotFound", "DeadlineExceeded", "Canceled"} {
		if !c.CheckClass("create", "px", cl, "", nil) {
			t.Errorf("class %s counted as a violation", cl)
		}
	}
	if c.CheckClass("create", "px", "Permanent", "kvm2 lab1: digest mismatch", []string{"mirror-short"}) {
		t.Error("Permanent passed")
	}
	if c.CheckClass("create", "px", "Unknown", "", nil) {
		t.Error("class Unknown passed")
	}
	if n := len(c.Violations()); n != 3 {
		t.Errorf("%d violations, want 3: %v", n, c.Violations())
	}
}

func TestDiff(t *testing.T) {
	desired := map[string]string{"a": "a-1", "b": "b-2", "c": "c-1"}
	actual := []Observed{
		{"a", "a-1", "Running"},
		{"b", "b-1", "Running"},
		{"d", "d-3", "Running"},
		{"c", "c-1", "Provisioning"},
	}
	got := Diff(desired, actual)
	want := []string{"b has UID b-1, want b-2", "c/c-1 is Provisioning, want Running", "undesired d/d-3 (Running)"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Diff = %q, want %q", got, want)
	}
	if d := Diff(map[string]string{"c": "c-1"}, []Observed{{"c", "c-1", "Provisioning"}}, "Running", "Provisioning"); len(d) != 0 {
		t.Errorf("Provisioning not accepted as up: %q", d)
	}
	if d := Diff(map[string]string{"c": "c-1"}, []Observed{{"c", "c-1", "Stopped"}}, "Running", "Provisioning"); len(d) != 1 {
		t.Errorf("Stopped accepted as up: %q", d)
	}
	if d := Diff(map[string]string{"a": "a-1"}, nil); !reflect.DeepEqual(d, []string{"missing a/a-1"}) {
		t.Errorf("Diff of nothing = %q", d)
	}
	if d := Diff(map[string]string{"a": "a-1"}, []Observed{{"a", "a-1", "Running"}}); len(d) != 0 {
		t.Errorf("converged Diff = %q", d)
	}
	vols := []string{"base-e1--tiny.qcow2", "ep-e1--a.qcow2", "ep-e1--a-seed.iso", "ep-e1--z-seed.iso", "ep-e2--b.qcow2", "foreign.img"}
	vd := VolumeDiff("ep-e1--", []string{"a", "b"}, vols)
	if want := []string{"missing overlay ep-e1--b.qcow2", "orphan volume ep-e1--z-seed.iso"}; !reflect.DeepEqual(vd, want) {
		t.Errorf("VolumeDiff = %q, want %q", vd, want)
	}
}

func TestCheckGrowth(t *testing.T) {
	c := NewChecker(nil)
	if !c.CheckGrowth(InvGoroutines, 100, 112, 0.10, 2) {
		t.Error("+12 of 100 with slack 2 failed")
	}
	if c.CheckGrowth(InvGoroutines, 100, 113, 0.10, 2) {
		t.Error("+13 of 100 with slack 2 passed")
	}
}

func TestReport(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 15, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	ev := []Event{
		{T: at(0), Kind: EvStep, Op: "create", Host: 1},
		{T: at(0), Kind: EvStep, Op: "create", Host: 2},
		{T: at(1), Kind: EvStep, Op: "link-down", Host: 2},
		{T: at(1), Kind: EvStep, Op: "mirror-503"},
	}
	for i := 1; i <= 100; i++ {
		ev = append(ev, Event{T: at(1), Kind: EvCall, Op: "get", Host: 1, Result: "OK", Latency: time.Duration(i) * time.Millisecond})
	}
	ev = append(ev,
		Event{T: at(5), Kind: EvFaultEnd, Op: "link-down", Host: 2},
		Event{T: at(6), Kind: EvCall, Op: "check", Host: 2, Result: "Transient", Latency: time.Second},
		Event{T: at(7.5), Kind: EvCall, Op: "check", Host: 2, Result: "OK", Latency: time.Second},
		Event{T: at(8), Kind: EvFaultEnd, Op: "mirror-503"},
	)
	c := NewChecker(nil)
	c.Check(InvBudget, true, "")
	c.Check(InvBudget, false, "get px took 40s")
	r := Summarize(Meta{Seed: 77, Duration: 5 * time.Minute, Hosts: 3, Command: "make soak SOAK=5m SOAK_SEED=77"}, ev, c)
	if s := r.Calls["get"]; s.N != 100 || s.P50 != 50*time.Millisecond || s.P99 != 99*time.Millisecond || s.Max != 100*time.Millisecond {
		t.Errorf("get stats %+v, want 100 calls, p50 50ms, p99 99ms, max 100ms", s)
	}
	if d := r.Recover["link-down"]; len(d) != 1 || d[0] != 2500*time.Millisecond {
		t.Errorf("link-down recovered in %v, want [2.5s] (the first OK after its end)", d)
	}
	if r.Unrecovered["mirror-503"] != 1 {
		t.Errorf("mirror-503 not counted unrecovered: %v", r.Unrecovered)
	}
	if r.Ops["create"] != 2 || r.Faults["link-down"] != 1 || r.TotalCalls != 102 {
		t.Errorf("ops %v faults %v calls %d", r.Ops, r.Faults, r.TotalCalls)
	}
	var b bytes.Buffer
	if err := r.Write(&b); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	for _, want := range []string{
		"seed: 77", "make soak SOAK=5m SOAK_SEED=77", "violations: **1**",
		"| get | 100 | 50ms | 99ms | 100ms | OK 100 |",
		"| link-down | 1 | 2.5s | 2.5s | 2.5s | 0 |",
		"| mirror-503 | 1 | - | - | - | 1 |",
		"| create | 2 |",
		"| call-within-budget | 2 |",
		"`call-within-budget`: get px took 40s",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
}

// TestCompareEventLogs is the replay check on the lab: with
// SOAK_COMPARE=a.jsonl,b.jsonl (the event logs of two runs with one seed
// and host count) it fails unless their scheduled steps, in order, are
// identical; without it, it is skipped.
func TestCompareEventLogs(t *testing.T) {
	v := os.Getenv("SOAK_COMPARE")
	if v == "" {
		t.Skip("SOAK_COMPARE unset (two event logs, comma-separated)")
	}
	paths := strings.Split(v, ",")
	if len(paths) != 2 {
		t.Fatalf("SOAK_COMPARE=%q: want two paths, comma-separated", v)
	}
	var steps [2][]string
	var calls [2]int
	for i, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		ev, err := ReadEvents(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		steps[i] = StepEvents(ev)
		for _, e := range ev {
			if e.Kind == EvCall {
				calls[i]++
			}
		}
	}
	if len(steps[0]) == 0 {
		t.Fatalf("%s holds no scheduled step", paths[0])
	}
	for i := range max(len(steps[0]), len(steps[1])) {
		var a, b string
		if i < len(steps[0]) {
			a = steps[0][i]
		}
		if i < len(steps[1]) {
			b = steps[1][i]
		}
		if a != b {
			t.Fatalf("step %d differs:\n  %s: %s\n  %s: %s", i, paths[0], a, paths[1], b)
		}
	}
	t.Logf("%d scheduled steps identical, in order (calls made: %d and %d, which the library's timing decides)", len(steps[0]), calls[0], calls[1])
}

// TestScheduleNewFaults checks the pool-full and driver-kill faults: a
// pool-full fault is always on the pool host (and absent without one), a
// driver-sigkill concerns no host and keeps the driver down at most
// DriverDownMax, and every kind shows up over a few seeds.
func TestScheduleNewFaults(t *testing.T) {
	seen := map[Kind]int{}
	for seed := range uint64(40) {
		p := params(seed)
		p.PoolHost = 2
		s, err := NewSchedule(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range s {
			seen[x.Kind]++
			switch x.Kind {
			case FaultPoolFull:
				if x.Host != 2 {
					t.Fatalf("seed %d: %v not on the pool host 2", seed, x)
				}
			case FaultDriverKill:
				if x.Host != 0 || x.Dur <= 0 || x.Dur > p.DriverDownMax {
					t.Fatalf("seed %d: %v: want host 0 and 0 < dur <= %v", seed, x, p.DriverDownMax)
				}
			}
		}
		p.PoolHost = 0
		s, _ = NewSchedule(p)
		for _, x := range s {
			if x.Kind == FaultPoolFull {
				t.Fatalf("seed %d: %v without a pool host", seed, x)
			}
		}
	}
	for _, k := range append(slices.Clone(OpKinds), FaultKinds...) {
		if seen[k] == 0 {
			t.Errorf("no %s in 40 seeds", k)
		}
	}
	if p := params(1); p.PoolHost != 1 {
		t.Errorf("DefaultParams PoolHost = %d, want 1", p.PoolHost)
	}
	p := params(1)
	p.PoolHost = 4
	if _, err := NewSchedule(p); err == nil {
		t.Error("PoolHost 4 of 3 hosts accepted")
	}
}
