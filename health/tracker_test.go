package health

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/google/go-cmp/cmp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"pgregory.net/rapid"

	"github.com/egressproxy/egressproxy/internal/errs"
)

var okResult = Result{OK: true, StatusCode: 200, Total: 3 * time.Millisecond}

func failResult(k Kind) Result {
	return Result{Kind: k, Err: &ProbeError{Kind: k, Op: "dial"}, Total: time.Second}
}

// fakeClock is a settable clock for the tracker.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func TestNewTrackerRejectsBadOptions(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		opts TrackerOptions
		want []string
	}{
		{name: "negative rise", opts: TrackerOptions{Rise: -1}, want: []string{"Rise"}},
		{name: "negative fall", opts: TrackerOptions{Fall: -1}, want: []string{"Fall"}},
		{name: "negative grace", opts: TrackerOptions{Grace: -time.Second}, want: []string{"Grace"}},
		{name: "all", opts: TrackerOptions{Rise: -1, Fall: -2, Grace: -1}, want: []string{"Rise", "Fall", "Grace"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, err := NewTracker(&tt.opts)
			if err == nil || tr != nil {
				t.Fatalf("NewTracker accepted %+v", tt.opts)
			}
			var fields []string
			for _, fe := range errs.FieldErrors(err) {
				fields = append(fields, fe.Field)
			}
			if diff := cmp.Diff(tt.want, fields); diff != "" || errs.Code(err) != errs.Permanent {
				t.Errorf("error %q (class %v): FieldError fields (-want +got):\n%s", err, errs.Code(err), diff)
			}
		})
	}
	tr, err := NewTracker(nil)
	if err != nil || tr.rise != defaultRise || tr.fall != defaultFall || tr.grace != defaultGrace {
		t.Fatalf("defaults: %v %+v", err, tr)
	}
}

func TestTrackerSequences(t *testing.T) {
	t.Parallel()
	const addr = "10.0.0.7:3128"
	type step struct {
		advance time.Duration
		obs     []observation // the whole round
		remove  string
		want    map[string]State // tracked IDs and their states after the step
		forgot  []string         // OnForget calls during the step
	}
	ok := func(id string) observation { return observation{id: id, address: addr, result: okResult} }
	bad := func(id string) observation {
		return observation{id: id, address: addr, result: failResult(KindRefused)}
	}
	noAddr := func(id string) observation { return observation{id: id} }
	tests := []struct {
		name  string
		steps []step
	}{
		{name: "rise after N successes", steps: []step{
			{obs: []observation{ok("a")}, want: map[string]State{"a": StateUnknown}},
			{obs: []observation{ok("a")}, want: map[string]State{"a": StateHealthy}},
		}},
		{name: "fall after M failures, not before", steps: []step{
			{obs: []observation{ok("a")}}, {obs: []observation{ok("a")}},
			{obs: []observation{bad("a")}, want: map[string]State{"a": StateHealthy}},
			{obs: []observation{bad("a")}, want: map[string]State{"a": StateHealthy}},
			{obs: []observation{ok("a")}, want: map[string]State{"a": StateHealthy}},
			{obs: []observation{bad("a")}}, {obs: []observation{bad("a")}},
			{obs: []observation{bad("a")}, want: map[string]State{"a": StateUnhealthy}},
			{obs: []observation{ok("a")}, want: map[string]State{"a": StateUnhealthy}},
			{obs: []observation{ok("a")}, want: map[string]State{"a": StateHealthy}},
		}},
		{name: "one empty address read keeps a healthy proxy", steps: []step{
			{obs: []observation{ok("a")}}, {obs: []observation{ok("a")}},
			{advance: 30 * time.Second, obs: []observation{noAddr("a")}, want: map[string]State{"a": StateHealthy}},
			{advance: 30 * time.Second, obs: []observation{ok("a")}, want: map[string]State{"a": StateHealthy}},
		}},
		{name: "forgotten after grace without address", steps: []step{
			{obs: []observation{ok("a"), ok("b")}}, {obs: []observation{ok("a"), ok("b")}},
			{advance: 59 * time.Second, obs: []observation{noAddr("a"), ok("b")}, want: map[string]State{"a": StateHealthy, "b": StateHealthy}},
			{advance: 1 * time.Second, obs: []observation{noAddr("a"), ok("b")}, want: map[string]State{"b": StateHealthy}, forgot: []string{"a"}},
			{advance: 1 * time.Second, obs: []observation{ok("a"), ok("b")}, want: map[string]State{"a": StateUnknown, "b": StateHealthy}},
		}},
		{name: "missing from rounds is like no address", steps: []step{
			{obs: []observation{bad("a"), ok("b")}},
			{advance: 40 * time.Second, obs: []observation{ok("b")}, want: map[string]State{"a": StateUnknown, "b": StateHealthy}},
			{advance: 40 * time.Second, obs: nil, want: map[string]State{"b": StateHealthy}, forgot: []string{"a"}},
			{advance: 20 * time.Second, obs: nil, want: map[string]State{}, forgot: []string{"b"}},
			{advance: time.Hour, obs: nil, want: map[string]State{}},
		}},
		{name: "never seen with an address: grace from first report", steps: []step{
			{obs: []observation{noAddr("a")}, want: map[string]State{"a": StateUnknown}},
			{advance: 60 * time.Second, obs: []observation{noAddr("a")}, want: map[string]State{}, forgot: []string{"a"}},
		}},
		{name: "canceled probes do not count", steps: []step{
			{obs: []observation{ok("a")}}, {obs: []observation{ok("a")}},
			{obs: []observation{{id: "a", address: addr, result: failResult(KindCanceled)}}},
			{obs: []observation{{id: "a", address: addr, result: failResult(KindCanceled)}}},
			{advance: 50 * time.Second, obs: []observation{{id: "a", address: addr, result: failResult(KindCanceled)}}, want: map[string]State{"a": StateHealthy}},
			{advance: 50 * time.Second, obs: []observation{noAddr("a")}, want: map[string]State{"a": StateHealthy}},
		}},
		{name: "remove forgets at once", steps: []step{
			{obs: []observation{ok("a")}},
			{remove: "a", want: map[string]State{}, forgot: []string{"a"}},
			{remove: "a", want: map[string]State{}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := &fakeClock{now: time.Unix(1_000_000, 0)}
			var forgot []string
			tr, err := NewTracker(&TrackerOptions{Rise: 2, Fall: 3, Grace: time.Minute, Now: clock.Now,
				OnForget: func(s Status) { forgot = append(forgot, s.ID) }})
			if err != nil {
				t.Fatal(err)
			}
			for i, st := range tt.steps {
				forgot = nil
				clock.Advance(st.advance)
				if st.remove != "" {
					tr.Remove(st.remove)
				} else {
					tr.update(st.obs)
				}
				if st.want != nil {
					got := map[string]State{}
					for _, s := range tr.Snapshot() {
						got[s.ID] = s.State
					}
					if diff := cmp.Diff(st.want, got); diff != "" {
						t.Fatalf("step %d: states (-want +got):\n%s", i, diff)
					}
				}
				if diff := cmp.Diff(st.forgot, forgot, cmp.Transformer("sort", sortStrings)); diff != "" {
					t.Fatalf("step %d: forgotten (-want +got):\n%s", i, diff)
				}
			}
		})
	}
}

func sortStrings(in []string) []string {
	out := append([]string(nil), in...)
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

func TestTrackerSnapshotFields(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: time.Unix(5000, 0)}
	var last Status
	tr, _ := NewTracker(&TrackerOptions{Rise: 1, Fall: 1, Now: clock.Now, OnForget: func(s Status) { last = s }})
	tr.update([]observation{{id: "a", address: "1.2.3.4:3128", result: okResult}})
	s, ok := tr.Get("a")
	if !ok || !s.Healthy() || s.Address != "1.2.3.4:3128" || s.LastLatency != okResult.Total || s.LastErr != nil ||
		!s.Since.Equal(clock.Now()) || !s.LastProbe.Equal(clock.Now()) || s.Successes != 1 || s.LastStatusCode != 200 {
		t.Fatalf("after success: %+v", s)
	}
	clock.Advance(time.Second)
	fail := failResult(KindAuthRequired)
	fail.StatusCode = 407
	tr.update([]observation{{id: "a", address: "1.2.3.4:3128", result: fail}})
	s, _ = tr.Get("a")
	if s.State != StateUnhealthy || !errors.As(s.LastErr, new(*ProbeError)) || s.LastKind != KindAuthRequired ||
		s.LastStatusCode != 407 || !s.Since.Equal(clock.Now()) || s.Failures != 1 || s.Successes != 0 {
		t.Fatalf("after failure: %+v", s)
	}
	if _, ok := tr.Get("b"); ok {
		t.Fatal("Get of an unknown ID succeeded")
	}
	if !tr.Remove("a") || last.ID != "a" || last.State != StateUnhealthy {
		t.Fatalf("OnForget got %+v", last)
	}
}

// TestTrackerProperties drives a Tracker with random rounds, clock steps and
// removals, and checks it against a model kept as plain history.
func TestTrackerProperties(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(rt *rapid.T) {
		rise := rapid.IntRange(1, 4).Draw(rt, "rise")
		fall := rapid.IntRange(1, 4).Draw(rt, "fall")
		grace := time.Duration(rapid.IntRange(1, 10).Draw(rt, "graceHalfSeconds")) * 500 * time.Millisecond
		clock := &fakeClock{now: time.Unix(1_000_000, 0)}
		hookCalls := map[string]int{}
		tr, err := NewTracker(&TrackerOptions{Rise: rise, Fall: fall, Grace: grace, Now: clock.Now,
			OnForget: func(s Status) { hookCalls[s.ID]++ }})
		if err != nil {
			rt.Fatal(err)
		}
		type entry struct {
			history  []bool // probe outcomes since tracked
			lastSeen time.Time
		}
		model := map[string]*entry{}
		forgets := map[string]int{}
		ids := []string{"a", "b", "c", "d"}

		check := func(rt *rapid.T, prev map[string]Status) {
			now := clock.Now()
			cur := map[string]Status{}
			for _, s := range tr.Snapshot() {
				cur[s.ID] = s
			}
			if len(cur) != len(model) {
				rt.Fatalf("tracker has %d proxies, model %d", len(cur), len(model))
			}
			for id, m := range model {
				s, ok := cur[id]
				if !ok {
					rt.Fatalf("%s forgotten %v after last seen (grace %v)", id, now.Sub(m.lastSeen), grace)
				}
				// Trailing runs and the state the history implies: the later of
				// the last point a success run reached rise and the last
				// point a failure run reached fall.
				succ, fail, lastRise, lastFall := 0, 0, -1, -1
				for i, ok := range m.history {
					if ok {
						succ, fail = succ+1, 0
						if succ >= rise {
							lastRise = i
						}
					} else {
						succ, fail = 0, fail+1
						if fail >= fall {
							lastFall = i
						}
					}
				}
				want := StateUnknown
				switch {
				case lastRise > lastFall:
					want = StateHealthy
				case lastFall > lastRise:
					want = StateUnhealthy
				}
				if s.State != want || s.Successes != succ || s.Failures != fail {
					rt.Fatalf("%s: state %v (%d ok, %d failed in a row), history %v implies %v (%d, %d)",
						id, s.State, s.Successes, s.Failures, m.history, want, succ, fail)
				}
				// Never healthy without a run of rise successes, never
				// unhealthy without a run of fall failures (in this
				// tracking life of the proxy).
				if s.State == StateHealthy && lastRise < 0 {
					rt.Fatalf("%s healthy without %d consecutive successes: %v", id, rise, m.history)
				}
				if s.State == StateUnhealthy && lastFall < 0 {
					rt.Fatalf("%s unhealthy without %d consecutive failures: %v", id, fall, m.history)
				}
				if p, ok := prev[id]; ok && p.State != s.State && !s.Since.Equal(now) {
					rt.Fatalf("%s changed state but Since is %v, now %v", id, s.Since, now)
				}
			}
			if diff := cmp.Diff(forgets, hookCalls); diff != "" {
				rt.Fatalf("OnForget calls (-want +got):\n%s", diff)
			}
		}

		rt.Repeat(map[string]func(*rapid.T){
			"round": func(rt *rapid.T) {
				clock.Advance(time.Duration(rapid.IntRange(0, 12).Draw(rt, "advanceQuarterSeconds")) * 250 * time.Millisecond)
				now := clock.Now()
				prev := map[string]Status{}
				for _, s := range tr.Snapshot() {
					prev[s.ID] = s
				}
				n := rapid.IntRange(0, 6).Draw(rt, "observations")
				var obs []observation
				for i := 0; i < n; i++ {
					ob := observation{id: rapid.SampledFrom(ids).Draw(rt, "id")}
					if rapid.IntRange(0, 3).Draw(rt, "hasAddr") > 0 {
						ob.address = "10.0.0.1:3128"
						if rapid.Bool().Draw(rt, "ok") {
							ob.result = okResult
						} else {
							ob.result = failResult(KindTimeout)
						}
					}
					obs = append(obs, ob)
				}
				tr.update(obs)
				for _, ob := range obs {
					m := model[ob.id]
					if m == nil {
						m = &entry{lastSeen: now}
						model[ob.id] = m
					}
					if ob.address != "" {
						m.lastSeen = now
						m.history = append(m.history, ob.result.OK)
					}
				}
				for id, m := range model {
					if now.Sub(m.lastSeen) >= grace {
						delete(model, id)
						forgets[id]++
					}
				}
				// Never forgotten before the grace period: whatever the
				// tracker dropped this round was last seen at least grace ago.
				for id, p := range prev {
					if _, still := tr.Get(id); !still && now.Sub(p.LastSeen) < grace {
						rt.Fatalf("%s forgotten %v after it was last seen, grace %v", id, now.Sub(p.LastSeen), grace)
					}
				}
				check(rt, prev)
			},
			"remove": func(rt *rapid.T) {
				id := rapid.SampledFrom(ids).Draw(rt, "id")
				prev := map[string]Status{}
				for _, s := range tr.Snapshot() {
					prev[s.ID] = s
				}
				got := tr.Remove(id)
				if _, want := model[id]; got != want {
					rt.Fatalf("Remove(%s) = %v, tracked %v", id, got, want)
				}
				if got {
					delete(model, id)
					forgets[id]++
				}
				delete(prev, id)
				check(rt, prev)
			},
		})
	})
}

func TestTrackerConcurrentForgetOnce(t *testing.T) {
	t.Parallel()
	var calls sync.Map // id -> *atomic.Int64
	tr, _ := NewTracker(&TrackerOptions{Rise: 1, Fall: 1, Grace: time.Nanosecond, OnForget: func(s Status) {
		v, _ := calls.LoadOrStore(s.ID, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}})
	const rounds = 200
	var removed atomic.Int64
	for r := 0; r < rounds; r++ {
		id := fmt.Sprint("p", r)
		tr.update([]observation{{id: id, address: "10.0.0.1:1", result: okResult}})
		var wg sync.WaitGroup
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if tr.Remove(id) {
					removed.Add(1)
				}
				tr.update(nil) // forgets whatever is past grace
				tr.Snapshot()
			}()
		}
		wg.Wait()
		v, ok := calls.Load(id)
		if !ok || v.(*atomic.Int64).Load() != 1 {
			t.Fatalf("%s: OnForget not called exactly once", id)
		}
	}
	if removed.Load() > rounds {
		t.Fatalf("Remove returned true %d times for %d proxies", removed.Load(), rounds)
	}
}

func TestTrackerRound(t *testing.T) {
	t.Parallel()
	good := startFake(t, reply("HTTP/1.1 200 OK\r\n\r\n")).addr
	denied := startFake(t, reply("HTTP/1.1 403 Forbidden\r\n\r\n")).addr
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	clock := &fakeClock{now: time.Unix(10, 0)}
	var forgot []string
	tr, err := NewTracker(&TrackerOptions{Rise: 2, Fall: 2, Grace: time.Minute, Now: clock.Now, TracerProvider: tp,
		OnForget: func(s Status) { forgot = append(forgot, s.ID) }})
	if err != nil {
		t.Fatal(err)
	}
	members := []Proxy{{ID: "good", Address: good}, {ID: "denied", Address: denied}, {ID: "booting"}}
	opts := &ProbeAllOptions{Target: "example.test:443", Workers: 2}
	for i := 0; i < 2; i++ {
		res, err := tr.Round(context.Background(), members, opts)
		if err != nil || len(res) != 2 || res[0].ID != "good" || !res[0].OK || res[1].ID != "denied" || res[1].Kind != KindProxyStatus {
			t.Fatalf("round %d results %+v, %v", i, res, err)
		}
	}
	want := map[string]State{"good": StateHealthy, "denied": StateUnhealthy, "booting": StateUnknown}
	got := map[string]State{}
	for _, s := range tr.Snapshot() {
		got[s.ID] = s.State
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("states (-want +got):\n%s", diff)
	}
	clock.Advance(time.Minute)
	if _, err := tr.Round(context.Background(), []Proxy{{ID: "good", Address: good}}, opts); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"booting", "denied"}, sortStrings(forgot)); diff != "" {
		t.Fatalf("forgotten (-want +got):\n%s", diff)
	}
	var rounds, probeAlls int
	for _, s := range rec.Ended() {
		switch s.Name() {
		case "health.Round":
			rounds++
		case "health.ProbeAll":
			probeAlls++
			if !s.Parent().IsValid() {
				t.Error("health.ProbeAll span has no parent")
			}
		}
	}
	if rounds != 3 || probeAlls != 3 {
		t.Fatalf("%d round spans and %d ProbeAll spans, want 3 each", rounds, probeAlls)
	}
}

func TestTrackerLogsThroughLogr(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var lines []string
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		lines = append(lines, args)
		mu.Unlock()
	}, funcr.Options{Verbosity: 1})
	clock := &fakeClock{now: time.Unix(0, 0)}
	tr, _ := NewTracker(&TrackerOptions{Rise: 1, Fall: 1, Grace: time.Second, Now: clock.Now, Logger: log})
	tr.update([]observation{{id: "a", address: "10.0.0.1:3128", result: okResult}})
	clock.Advance(time.Second)
	tr.update(nil)
	joined := strings.Join(lines, "\n")
	for _, want := range []string{`"msg"="proxy health changed" "id"="a"`, `"to"="healthy"`, `"msg"="proxy forgotten" "id"="a"`} {
		if !strings.Contains(joined, want) {
			t.Errorf("logs lack %s:\n%s", want, joined)
		}
	}
}

// Round without a CONNECT target for a proxy (nil options, or options
// without Target, and a proxy without one of its own) is the caller's
// mistake, not the proxies': Round returns a Permanent error naming Target,
// connects nowhere and records nothing — never a fleet marked down, never a
// round that silently does nothing. With nil options and every proxy
// carrying its own Target, the round runs on the documented defaults.
func TestRoundWithoutTarget(t *testing.T) {
	t.Parallel()
	var conns atomic.Int64
	good := startFake(t, func(c net.Conn) { conns.Add(1); reply("HTTP/1.1 200 OK\r\n\r\n")(c) }).addr
	clock := &fakeClock{now: time.Unix(10, 0)}
	tr, err := NewTracker(&TrackerOptions{Rise: 1, Fall: 1, Grace: time.Minute, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	proxies := []Proxy{{ID: "good", Address: good}}
	if _, err := tr.Round(context.Background(), proxies, &ProbeAllOptions{Target: "example.test:443"}); err != nil {
		t.Fatal(err)
	}
	first := clock.Now()
	clock.Advance(time.Second)
	for _, opts := range []*ProbeAllOptions{nil, {Workers: 2}} {
		for _, ps := range [][]Proxy{proxies, {{ID: "booting"}, {ID: "good", Address: good}}} {
			res, err := tr.Round(context.Background(), ps, opts)
			fes := errs.FieldErrors(err)
			if res != nil || len(fes) != 1 || fes[0].Field != "Target" || errs.Code(err) != errs.Permanent {
				t.Fatalf("Round(%v, %v) = %+v, %v; want no results and a Permanent error for Target", ps, opts, res, err)
			}
			if !strings.Contains(err.Error(), `"good"`) {
				t.Errorf("error %q does not name the proxy without a target", err)
			}
		}
	}
	if s := tr.Snapshot(); len(s) != 1 || s[0].State != StateHealthy || !s[0].LastSeen.Equal(first) {
		t.Fatalf("states after rounds without a target: %+v, want only good, still Healthy and last seen at %v", s, first)
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d connections to the proxy, want 1 (rounds without a target connect nowhere)", n)
	}

	// nil options: every default, each proxy with its own target.
	res, err := tr.Round(context.Background(), []Proxy{{ID: "own", Address: good, Target: "example.test:443"}, {ID: "booting"}}, nil)
	if err != nil || len(res) != 1 || !res[0].OK || res[0].Target != "example.test:443" {
		t.Fatalf("Round with nil options and a proxy's own target: %+v, %v", res, err)
	}
	if s, ok := tr.Get("own"); !ok || s.State != StateHealthy || s.LastProbe.IsZero() {
		t.Fatalf("proxy probed with nil options: %+v, %v; want recorded and Healthy (Rise 1)", s, ok)
	}
	if _, ok := tr.Get("booting"); !ok {
		t.Fatal("proxy without an address not tracked by a round with nil options")
	}
}
