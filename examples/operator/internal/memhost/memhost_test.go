package memhost

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func serve(t *testing.T, entries ...memprovider.Options) *Server {
	t.Helper()
	s, err := Serve("127.0.0.1:0", entries)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s
}

func client(t *testing.T, s *Server, entry string) *egressproxy.Client {
	t.Helper()
	c, err := NewClient(s.URL(), entry, ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// A VM created through one client is found by another (the standby of a
// killed operator), and outlives the client that created it; each entry
// has its own VMs; the host's call delay is waited.
func TestVMsOutliveTheirClient(t *testing.T) {
	s := serve(t, memprovider.Options{Entry: "m1", ServeProxies: true, CallDelay: 20 * time.Millisecond}, memprovider.Options{Entry: "m2"})
	ctx := context.Background()
	first := client(t, s, "m1")
	spec := egressproxy.Spec{Name: "ep-a", UID: "uid-a"}
	t0 := time.Now()
	inst, err := first.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(t0); took < 20*time.Millisecond {
		t.Errorf("Create took %v, want at least the host's 20ms call delay", took)
	}
	if inst.IP != "127.0.0.1" || inst.Port == 0 || inst.State != egressproxy.StateRunning || inst.SpecDigest != spec.Digest() {
		t.Fatalf("Create = %+v, want a Running served loopback proxy of the spec's digest", inst)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	second := client(t, s, "m1")
	got, err := second.Get(ctx, inst.Ref)
	if err != nil || got.Address() != inst.Address() || !got.CreatedAt.Equal(inst.CreatedAt) {
		t.Fatalf("Get through another client = %+v, %v; want %+v", got, err, inst)
	}
	again, err := second.Create(ctx, spec)
	if err != nil || again.Address() != inst.Address() {
		t.Errorf("Create again = %+v, %v; want the same VM", again, err)
	}
	listCheckDelete(t, s, second, inst)
}

// listCheckDelete: List, Check and Delete through c, the only VM of its
// entry inst; the host's other entry m2 has none.
func listCheckDelete(t *testing.T, s *Server, c *egressproxy.Client, inst egressproxy.Instance) {
	t.Helper()
	ctx := context.Background()
	second := c
	list, err := second.List(ctx)
	if err != nil || len(list) != 1 || list[0].Name != "ep-a" {
		t.Errorf("List = %+v, %v; want ep-a", list, err)
	}
	if l2, err := client(t, s, "m2").List(ctx); err != nil || len(l2) != 0 {
		t.Errorf("m2's List = %+v, %v; want none (each entry has its own VMs)", l2, err)
	}
	h, err := second.Check(ctx)
	if err != nil || !h.Reachable || h.Capacity == nil || h.Capacity.Instances != 1 {
		t.Errorf("Check = %+v, %v; want reachable with one instance", h, err)
	}
	if err := second.Delete(ctx, inst.Ref); err != nil {
		t.Fatal(err)
	}
	if _, err := second.Get(ctx, inst.Ref); egressproxy.Code(err) != egressproxy.NotFound {
		t.Errorf("Get after Delete = %v, want NotFound", err)
	}
}

// Every error keeps its class across the link, and the sentinels a caller
// tests with errors.Is; a host that is gone is Transient; a call after
// Close is ErrClosed.
func TestErrorClasses(t *testing.T) {
	s := serve(t, memprovider.Options{Entry: "m1"})
	ctx := context.Background()
	c := client(t, s, "m1")
	if _, err := c.Get(ctx, egressproxy.Ref{Name: "ep-none", UID: "u"}); egressproxy.Code(err) != egressproxy.NotFound || !errors.Is(err, egressproxy.ErrNotFound) {
		t.Errorf("Get of a missing VM = %v (%v), want NotFound", err, egressproxy.Code(err))
	}
	if _, err := c.Create(ctx, egressproxy.Spec{Name: "ep-a", UID: "uid-a"}); err != nil {
		t.Fatal(err)
	}
	_, err := c.Create(ctx, egressproxy.Spec{Name: "ep-a", UID: "uid-a", Port: 8080})
	if egressproxy.Code(err) != egressproxy.Permanent || !errors.Is(err, egressproxy.ErrSpecConflict) {
		t.Errorf("Create of another spec = %v (%v), want Permanent ErrSpecConflict", err, egressproxy.Code(err))
	}
	if _, err := c.Create(ctx, egressproxy.Spec{Name: "ep-a", UID: "uid-b"}); egressproxy.Code(err) != egressproxy.Permanent || errors.Is(err, egressproxy.ErrSpecConflict) {
		t.Errorf("Create of a taken name = %v (%v), want Permanent", err, egressproxy.Code(err))
	}
	if _, err := client(t, s, "nope").List(ctx); egressproxy.Code(err) != egressproxy.Permanent || !strings.Contains(err.Error(), `no entry "nope"`) {
		t.Errorf("List of an entry the host lacks = %v (%v), want Permanent naming it", err, egressproxy.Code(err))
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.List(ctx); !errors.Is(err, egressproxy.ErrClosed) {
		t.Errorf("List after Close = %v, want ErrClosed", err)
	}
	gone := client(t, s, "m1")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := gone.List(ctx); egressproxy.Code(err) != egressproxy.Transient {
		t.Errorf("List of a host that is gone = %v (%v), want Transient", err, egressproxy.Code(err))
	}
}

// The caller's context ends the request promptly, with its class; the
// host's call ends with it (the host reads the whole request first, else
// net/http does not notice the caller leave).
func TestContextEndsTheCall(t *testing.T) {
	s := serve(t, memprovider.Options{Entry: "slow", CallDelay: time.Minute})
	c := client(t, s, "slow")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	_, err := c.List(ctx)
	if egressproxy.Code(err) != egressproxy.DeadlineExceeded {
		t.Errorf("List past its deadline = %v (%v), want DeadlineExceeded", err, egressproxy.Code(err))
	}
	if took := time.Since(t0); took > 5*time.Second {
		t.Errorf("List took %v after its deadline of 100ms", took)
	}
	ctx2, cancel2 := context.WithCancel(context.Background())
	go func() { time.Sleep(50 * time.Millisecond); cancel2() }()
	if _, err := c.Check(ctx2); egressproxy.Code(err) != egressproxy.Canceled {
		t.Errorf("Check canceled = %v (%v), want Canceled", err, egressproxy.Code(err))
	}
	// The host's calls ended with their requests: Close, which waits for
	// the calls in progress, does not wait out the minute.
	t1 := time.Now()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(t1); took > 5*time.Second {
		t.Errorf("Close took %v: the host's calls outlived their requests", took)
	}
}

// Close of a client ends its calls in flight promptly (ErrClosed), and
// leaves no connection behind (goleak, TestMain).
func TestCloseEndsCalls(t *testing.T) {
	s := serve(t, memprovider.Options{Entry: "slow", CallDelay: time.Minute})
	c := client(t, s, "slow")
	errc := make(chan error, 1)
	go func() { _, err := c.List(context.Background()); errc <- err }()
	time.Sleep(100 * time.Millisecond) // the call is at the host
	t0 := time.Now()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, egressproxy.ErrClosed) {
		t.Errorf("the call in flight at Close = %v, want ErrClosed", err)
	}
	if took := time.Since(t0); took > 5*time.Second {
		t.Errorf("Close took %v with a call in flight", took)
	}
}

// Serve and NewClient refuse what is not a loopback endpoint, naming the
// rule; Serve refuses entries without a name or with one name twice.
func TestEndpointRules(t *testing.T) {
	for _, ep := range []string{"http://127.0.0.1:8080", "http://[::1]:1", "http://localhost:65535"} {
		if rule := CheckEndpoint(ep); rule != "" {
			t.Errorf("CheckEndpoint(%q) = %q, want none", ep, rule)
		}
	}
	for _, ep := range []string{"", "127.0.0.1:8080", "https://127.0.0.1:8080", "http://192.0.2.1:8080", "http://example.com:80",
		"http://127.0.0.1", "http://127.0.0.1:0", "http://127.0.0.1:8080/v1", "http://u@127.0.0.1:8080", "http://127.0.0.1:x"} {
		if rule := CheckEndpoint(ep); !strings.Contains(rule, "loopback") {
			t.Errorf("CheckEndpoint(%q) = %q, want the loopback rule", ep, rule)
		}
	}
	var fe *egressproxy.FieldError
	if _, err := NewClient("http://192.0.2.1:80", "m1", ClientOptions{}); !errors.As(err, &fe) || fe.Field != "endpoint" {
		t.Errorf("NewClient of a remote endpoint = %v, want a FieldError naming endpoint", err)
	}
	if _, err := Serve("192.0.2.1:0", nil); !errors.As(err, &fe) || fe.Field != "addr" {
		t.Errorf("Serve on a remote address = %v, want a FieldError naming addr", err)
	}
	if _, err := Serve("127.0.0.1:0", []memprovider.Options{{Entry: "a"}, {Entry: "a"}}); !errors.As(err, &fe) || fe.Field != "entries[1].Entry" {
		t.Errorf("Serve of one name twice = %v, want a FieldError naming entries[1].Entry", err)
	}
	if _, err := Serve("127.0.0.1:0", []memprovider.Options{{}}); !errors.As(err, &fe) || fe.Field != "entries[0].Entry" {
		t.Errorf("Serve of an unnamed entry = %v, want a FieldError naming entries[0].Entry", err)
	}
}
