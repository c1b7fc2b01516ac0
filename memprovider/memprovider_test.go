package memprovider_test

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/driver/drivertest"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/memprovider"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// harness makes fresh memproviders with fixed options.
type harness struct{ opts memprovider.Options }

func (h *harness) MakeProvider(context.Context) (driver.Provider, error) {
	o := h.opts
	return memprovider.NewDriver(&o), nil
}
func (h *harness) Close() {}

// MakeOtherEntryProvider: memproviders share nothing, so a second one is
// another entry. This makes the suite run its isolation subtest (whose
// checks matter for backends that share a host, like kvm2).
func (h *harness) MakeOtherEntryProvider(ctx context.Context) (driver.Provider, error) {
	return h.MakeProvider(ctx)
}

func maker(opts memprovider.Options) drivertest.HarnessMaker {
	return func(context.Context, *testing.T) (drivertest.Harness, error) {
		return &harness{opts: opts}, nil
	}
}

var suiteOptions = &drivertest.Options{RunningTimeout: 10 * time.Second, PollInterval: 10 * time.Millisecond, SubtestBudget: 30 * time.Second,
	OtherImageKey: "other-image", OtherMachineType: "other-type"}

func TestConformance(t *testing.T) {
	t.Parallel()
	withImages := *suiteOptions
	withImages.ImageKeys = []string{"default-image", "other-image"}
	for _, tt := range []struct {
		name  string
		opts  memprovider.Options
		suite *drivertest.Options
	}{
		{"Defaults", memprovider.Options{}, suiteOptions},
		{"ServeProxiesWithProvisionDelay", memprovider.Options{ServeProxies: true, ProvisionDelay: 30 * time.Millisecond}, suiteOptions},
		// A configured image catalogue: the image subtests also check
		// that an unconfigured key is Permanent.
		{"Images", memprovider.Options{Images: withImages.ImageKeys}, &withImages},
	} {
		t.Run(tt.name, func(t *testing.T) {
			drivertest.RunConformanceTests(t, maker(tt.opts), tt.suite)
		})
	}
}

func TestStateMachine(t *testing.T) {
	t.Parallel()
	drivertest.RunStateMachine(t, maker(memprovider.Options{ServeProxies: true}), suiteOptions)
}

// fakeClock is a settable clock.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func spec(name string) egressproxy.Spec { return egressproxy.Spec{Name: name, UID: "uid-" + name} }

func TestProvisionDelayFollowsClock(t *testing.T) {
	t.Parallel()
	clk := &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	p := newMem(&memprovider.Options{ProvisionDelay: time.Minute, Now: clk.Now})
	defer p.Close()
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("a"))
	if err != nil {
		t.Fatal(err)
	}
	if inst.State != egressproxy.StateProvisioning || inst.IP != "" {
		t.Fatalf("new instance = %+v, want Provisioning without IP", inst)
	}
	if !inst.CreatedAt.Equal(clk.Now()) {
		t.Errorf("CreatedAt = %v, want the clock's %v", inst.CreatedAt, clk.Now())
	}
	clk.Add(59 * time.Second)
	if inst, _ = p.Get(ctx, spec("a").Ref()); inst.State != egressproxy.StateProvisioning {
		t.Fatalf("after 59s: %v", inst.State)
	}
	clk.Add(time.Second)
	inst, _ = p.Get(ctx, spec("a").Ref())
	if inst.State != egressproxy.StateRunning || !strings.HasPrefix(inst.IP, "192.0.2.") || inst.Port != naming.DefaultPort || inst.AddressSource != "static" {
		t.Fatalf("after 60s: %+v, want Running at 192.0.2.x:%d", inst, naming.DefaultPort)
	}
}

func TestFaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	boom := errors.New("boom")
	tests := []struct {
		name     string
		op       memprovider.Op
		fault    memprovider.Fault
		call     func(mem) error
		want     []errs.ErrorCode // one per call, in order
		wantBoom bool
	}{
		{"transient once", memprovider.OpGet, memprovider.Fault{Code: errs.Transient, Times: 1},
			func(p mem) error { _, err := p.Get(ctx, spec("a").Ref()); return err },
			[]errs.ErrorCode{errs.Transient, errs.OK, errs.OK}, false},
		{"permanent twice with cause", memprovider.OpCreate, memprovider.Fault{Code: errs.Permanent, Err: boom, Times: 2},
			func(p mem) error { _, err := p.Create(ctx, spec("a")); return err },
			[]errs.ErrorCode{errs.Permanent, errs.Permanent, errs.OK}, true},
		{"always until cleared", memprovider.OpList, memprovider.Fault{Code: errs.Transient},
			func(p mem) error { _, err := p.List(ctx); return err },
			[]errs.ErrorCode{errs.Transient, errs.Transient, errs.Transient}, false},
		{"unclassed error", memprovider.OpDelete, memprovider.Fault{Err: boom, Times: 1},
			func(p mem) error { return p.Delete(ctx, spec("a").Ref()) },
			[]errs.ErrorCode{errs.Unknown, errs.OK}, true},
		{"delay only", memprovider.OpGet, memprovider.Fault{Delay: time.Millisecond, Times: 1},
			func(p mem) error { _, err := p.Get(ctx, spec("a").Ref()); return err },
			[]errs.ErrorCode{errs.OK, errs.OK}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newMem(nil)
			defer p.Close()
			if _, err := p.Create(ctx, spec("a")); err != nil {
				t.Fatal(err)
			}
			p.InjectFault(tt.op, tt.fault)
			for i, want := range tt.want {
				err := tt.call(p)
				if got := errs.Code(err); got != want {
					t.Fatalf("call %d: code %v, want %v (%v)", i, got, want, err)
				}
				if err != nil && tt.wantBoom && !errors.Is(err, boom) {
					t.Errorf("call %d: %v does not wrap the injected cause", i, err)
				}
			}
			p.ClearFaults()
			if err := tt.call(p); err != nil {
				t.Errorf("after ClearFaults: %v", err)
			}
		})
	}
}

func TestFaultDelayHonoursContextAndClose(t *testing.T) {
	t.Parallel()
	p := newMem(nil)
	p.InjectFault(memprovider.OpList, memprovider.Fault{Delay: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := p.List(ctx)
	if errs.Code(err) != errs.DeadlineExceeded {
		t.Fatalf("List with a delayed fault and a 20ms deadline: %v", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Fatalf("List did not return promptly")
	}
	waiting := make(chan struct{}, 1)
	p.ClearFaults()
	p.InjectFault(memprovider.OpList, memprovider.Fault{Delay: time.Hour, Waiting: func() { waiting <- struct{}{} }})
	done := make(chan error, 1)
	go func() { _, err := p.List(context.Background()); done <- err }()
	<-waiting // the List is in its delay now
	p.Close()
	select {
	case err := <-done:
		if !errors.Is(err, errs.ErrClosed) {
			t.Fatalf("delayed List after Close = %v, want ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not release a delayed call")
	}
}

func TestCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newMem(&memprovider.Options{ServeProxies: true})
	defer p.Close()
	p.Create(ctx, spec("a"))
	h, err := p.Check(ctx)
	if err != nil || !h.Reachable || h.Details["instances"] != "1" || h.Details["serveProxies"] != "true" {
		t.Fatalf("Check = %+v, %v", h, err)
	}
	// The default simulated host, with the one instance that runs.
	if want := (egressproxy.Capacity{MemoryAvailableBytes: 16 << 30, CPUs: 8, Instances: 1, PoolAvailableBytes: 100 << 30}); h.Capacity == nil || *h.Capacity != want {
		t.Errorf("Capacity = %+v, want %+v", h.Capacity, want)
	}
	p.InjectFault(memprovider.OpCheck, memprovider.Fault{Code: errs.Transient, Reason: egressproxy.ReasonUnauthorized, Err: errors.New("denied"), Times: 1})
	h, err = p.Check(ctx)
	if err != nil || h.Reachable || h.Reason != egressproxy.ReasonUnauthorized || h.Message != "denied" || h.Capacity != nil {
		t.Fatalf("Check with a fault = %+v, %v; want unreachable, Unauthorized, no Capacity, no error", h, err)
	}
	if h, _ = p.Check(ctx); !h.Reachable {
		t.Fatal("fault applied more than once")
	}
}

func TestSetState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newMem(&memprovider.Options{ServeProxies: true})
	defer p.Close()
	inst, _ := p.Create(ctx, spec("a"))
	if err := p.SetState(inst.Ref, egressproxy.StateFailed); err != nil {
		t.Fatal(err)
	}
	got, _ := p.Get(ctx, inst.Ref)
	if got.State != egressproxy.StateFailed || got.IP != "" {
		t.Fatalf("after SetState(Failed): %+v", got)
	}
	if _, err := net.Dial("tcp", inst.Address()); err == nil {
		t.Error("the proxy of a Failed instance still accepts connections")
	}
	p.SetState(inst.Ref, "")
	if got, _ = p.Get(ctx, inst.Ref); got.State != egressproxy.StateRunning || got.IP == "" {
		t.Fatalf("after SetState(\"\"): %+v", got)
	}
	if err := p.SetState(egressproxy.Ref{Name: "a", UID: "other"}, egressproxy.StateFailed); errs.Code(err) != errs.NotFound {
		t.Fatalf("SetState of a wrong UID: %v", err)
	}
}

// echoTarget serves a loopback TCP echo; it is stopped by the returned func.
func echoTarget(t *testing.T) (string, func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() { defer wg.Done(); defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String(), func() { ln.Close(); wg.Wait() }
}

// connect sends a CONNECT to proxy and returns the status and the conn.
func connect(t *testing.T, proxy, target, auth string) (int, net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.DialTimeout("tcp", proxy, 5*time.Second)
	if err != nil {
		t.Fatalf("dial proxy: %v", err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	req := "CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n"
	if auth != "" {
		req += "Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(auth)) + "\r\n"
	}
	io.WriteString(c, req+"\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		c.Close()
		t.Fatalf("read CONNECT answer: %v", err)
	}
	return resp.StatusCode, c, br
}

// userData renders c, failing t when it is invalid.
func userData(t *testing.T, c guest.Config) string {
	t.Helper()
	ud, err := guest.UserData(c, &guest.UserDataOptions{Salt: "test"})
	if err != nil {
		t.Fatal(err)
	}
	return ud
}

func TestServedProxy(t *testing.T) {
	t.Parallel()
	target, stop := echoTarget(t)
	defer stop()
	_, portText, _ := net.SplitHostPort(target)
	port, _ := strconv.Atoi(portText)
	loopback := []string{"127.0.0.0/8"}
	toTarget := []guest.Destination{{Ports: []int{port}}}
	users := []guest.User{{Name: "u", Password: "p"}}
	tests := []struct {
		name   string
		opts   memprovider.Options
		guest  *guest.Config // the description in the spec's user-data; nil: none
		target string
		auth   string
		want   int
	}{
		// Without a description: anyone, loopback targets only.
		{"tunnel to loopback", memprovider.Options{}, nil, target, "", http.StatusOK},
		{"non-loopback target forbidden", memprovider.Options{}, nil, "192.0.2.1:443", "", http.StatusForbidden},
		{"closed target is bad gateway", memprovider.Options{}, nil, "127.0.0.1:1", "", http.StatusBadGateway},
		// With one: what it describes.
		{"described client and port", memprovider.Options{}, &guest.Config{AllowedClients: loopback, AllowedDestinations: toTarget}, target, "", http.StatusOK},
		{"port 443 only by default", memprovider.Options{}, &guest.Config{AllowedClients: loopback}, target, "", http.StatusForbidden},
		{"client outside the ranges", memprovider.Options{}, &guest.Config{AllowedClients: []string{"10.0.0.0/8"}, AllowedDestinations: toTarget}, target, "", http.StatusForbidden},
		{"auth required", memprovider.Options{}, &guest.Config{Users: users, AllowedDestinations: toTarget}, target, "", http.StatusProxyAuthRequired},
		{"wrong password", memprovider.Options{}, &guest.Config{Users: users, AllowedDestinations: toTarget}, target, "u:x", http.StatusProxyAuthRequired},
		{"right password", memprovider.Options{}, &guest.Config{Users: users, AllowedDestinations: toTarget}, target, "u:p", http.StatusOK},
		{"domain not allowed", memprovider.Options{}, &guest.Config{Open: true, AllowedDestinations: []guest.Destination{{Ports: []int{port}, Domains: []string{"example.com"}}}}, target, "", http.StatusForbidden},
		{"allowed but beyond the dialer", memprovider.Options{}, &guest.Config{Open: true}, "192.0.2.1:443", "", http.StatusBadGateway},
		{"a dialer of the embedder's", memprovider.Options{DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, target)
		}}, &guest.Config{Open: true}, "192.0.2.1:443", "", http.StatusOK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.opts.ServeProxies = true
			p := newMem(&tt.opts)
			defer p.Close()
			s := spec("a")
			if tt.guest != nil {
				s.UserData = userData(t, *tt.guest)
			}
			inst, err := p.Create(context.Background(), s)
			if err != nil {
				t.Fatal(err)
			}
			if inst.IP != "127.0.0.1" || inst.AddressSource != "listener" {
				t.Fatalf("instance %+v does not point at a loopback listener", inst)
			}
			code, c, br := connect(t, inst.Address(), tt.target, tt.auth)
			defer c.Close()
			if code != tt.want {
				t.Fatalf("CONNECT %s: status %d, want %d", tt.target, code, tt.want)
			}
			if code != http.StatusOK {
				return
			}
			io.WriteString(c, "ping\n")
			line, err := br.ReadString('\n')
			if err != nil || line != "ping\n" {
				t.Fatalf("through the tunnel: %q, %v", line, err)
			}
		})
	}
}

// A guest description memprovider cannot serve as the spec says is
// refused at Create, Permanent, without quoting the user-data.
func TestCreateRefusesUnservableDescription(t *testing.T) {
	t.Parallel()
	p := newMem(&memprovider.Options{ServeProxies: true})
	defer p.Close()
	ctx := context.Background()
	ud := userData(t, guest.Config{Port: 8080, Users: []guest.User{{Name: "u", Password: "secret-pw"}}})
	s := spec("a")
	s.UserData = ud
	_, err := p.Create(ctx, s)
	if egressproxy.Code(err) != egressproxy.Permanent || !strings.Contains(err.Error(), "invalid Port \"3128\"") || !strings.Contains(err.Error(), "8080") {
		t.Errorf("Create with the description's port 8080 and the spec's 3128: %v, want a Permanent Port error", err)
	}
	s.Port = 8080
	if _, err := p.Create(ctx, s); err != nil {
		t.Errorf("Create with matching ports: %v", err)
	}
	bad := spec("b")
	bad.UserData = strings.Replace(ud, "http_access deny all", "http_access allow all\n      always_direct allow all", 1)
	_, err = p.Create(ctx, bad)
	if egressproxy.Code(err) != egressproxy.Permanent || !strings.Contains(err.Error(), "UserData") || !strings.Contains(err.Error(), "always_direct") {
		t.Errorf("Create with a description memprovider does not know: %v, want a Permanent UserData error naming the directive", err)
	}
	if strings.Contains(err.Error(), "$6$") || strings.Contains(err.Error(), "secret-pw") {
		t.Errorf("the error quotes the user-data: %v", err)
	}
	// User-data that is not a guest description is served as before.
	other := spec("c")
	other.UserData = "#cloud-config\nwrite_files: []\n"
	if _, err := p.Create(ctx, other); err != nil {
		t.Errorf("Create with other user-data: %v", err)
	}
}

func TestServedProxyStopsOnDeleteAndClose(t *testing.T) {
	// Not parallel: it dials addresses that were just freed, and a parallel
	// test's proxy may be given the same loopback port in between.
	target, stop := echoTarget(t)
	defer stop()
	ctx := context.Background()
	p := newMem(&memprovider.Options{ServeProxies: true})
	a, _ := p.Create(ctx, spec("a"))
	b, _ := p.Create(ctx, spec("b"))
	if a.Address() == b.Address() {
		t.Fatalf("two instances share %s", a.Address())
	}
	// An open tunnel through b must be cut by Close.
	code, tunnel, _ := connect(t, b.Address(), target, "")
	if code != http.StatusOK {
		t.Fatalf("CONNECT via b: %d", code)
	}
	defer tunnel.Close()
	if err := p.Delete(ctx, a.Ref); err != nil {
		t.Fatal(err)
	}
	if c, err := net.Dial("tcp", a.Address()); err == nil {
		c.Close()
		t.Error("deleted instance's proxy still accepts connections")
	}
	p.Close()
	if c, err := net.Dial("tcp", b.Address()); err == nil {
		c.Close()
		t.Error("proxy still accepts connections after Close")
	}
	tunnel.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := tunnel.Read(make([]byte, 1)); err == nil {
		t.Error("open tunnel survived Close")
	}
}

// Options.ProxyAddress is where the served proxies listen and what
// Instance.IP says; an address the host does not have fails the read that
// would start the proxy, Transient.
func TestProxyAddress(t *testing.T) {
	t.Parallel()
	target, stop := echoTarget(t)
	defer stop()
	ctx := context.Background()
	// 127.0.0.2 is the host's (all of 127/8 is loopback) but not the
	// default.
	p := newMem(&memprovider.Options{ServeProxies: true, ProxyAddress: netip.MustParseAddr("::ffff:127.0.0.2")})
	defer p.Close()
	a, err := p.Create(ctx, spec("a"))
	if err != nil {
		t.Fatal(err)
	}
	if a.IP != "127.0.0.2" || a.Port == 0 {
		t.Fatalf("instance at %q port %d, want 127.0.0.2 and the listener's port", a.IP, a.Port)
	}
	if code, tunnel, _ := connect(t, a.Address(), target, ""); code != http.StatusOK {
		t.Errorf("CONNECT via %s: %d", a.Address(), code)
	} else {
		tunnel.Close()
	}

	// 203.0.113.7 (documentation) is on no interface of a test host.
	q := newMem(&memprovider.Options{ServeProxies: true, ProxyAddress: netip.MustParseAddr("203.0.113.7")})
	defer q.Close()
	_, err = q.Create(ctx, spec("b"))
	if egressproxy.Code(err) != egressproxy.Transient || !strings.Contains(err.Error(), "serving the proxy") {
		t.Errorf("Create with a proxy address the host lacks: %v, want Transient, serving the proxy", err)
	}
}

func TestCopiesOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newMem(nil)
	defer p.Close()
	p.Create(ctx, spec("a"))
	l, _ := p.List(ctx)
	l[0].UID = "changed"
	l[0].State = egressproxy.StateFailed
	got, err := p.Get(ctx, spec("a").Ref())
	if err != nil || got.UID != "uid-a" || got.State != egressproxy.StateRunning {
		t.Fatalf("a caller's change to a List result leaked: %+v, %v", got, err)
	}
}

// mem is a memprovider driver with its Control, for tests of the driver
// itself (the examples show the public way: New and Client.As).
type mem struct {
	driver.Provider
	driver.ImageManager
	*memprovider.Control
}

func newMem(o *memprovider.Options) mem {
	d, c := memprovider.NewDriverControl(o)
	return mem{d, d.(driver.ImageManager), c}
}
