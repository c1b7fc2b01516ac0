package health_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
	"github.com/egressproxy/egressproxy/memprovider"
)

// The table of a proxy closed to strangers, against memprovider's served
// proxy of the guest description (the e2e test runs the same table
// against the booting guest): only the loopback address 127.0.0.1 is an
// allowed client, and the outsider comes from 127.0.0.2.
func TestGuardTableMemprovider(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g := guesttest.NewGuard(t, []string{"127.0.0.1/32"}, guesttest.ServeTarget(t, "127.0.0.1"), guesttest.ServeEcho(t, "127.0.0.1"))
	p := memprovider.New(&memprovider.Options{ServeProxies: true})
	defer p.Close()
	ud, err := guest.UserData(g.Config(3128), nil)
	if err != nil {
		t.Fatal(err)
	}
	inst, err := p.Create(ctx, egressproxy.Spec{Name: "proxy-a", UID: "uid-a", UserData: ud})
	if err != nil {
		t.Fatal(err)
	}
	outsider := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	g.Run(t, ctx, guesttest.GuardSite{Proxy: inst.Address(), Egress: "127.0.0.1", Outsider: outsider.DialContext})
}

// A provider instance's proxy is probed at inst.Address(): memprovider
// serves one with the basic auth its guest description asks for; the right credentials get
// through, none get 407, in Probe, ProbeAll and Tracker.Round alike.
func TestProbeInstanceCredentials(t *testing.T) {
	const body = "target ok"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, body) }))
	defer srv.Close()
	target := strings.TrimPrefix(srv.URL, "http://")

	p := memprovider.New(&memprovider.Options{ServeProxies: true})
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, port, _ := net.SplitHostPort(target)
	portN, _ := strconv.Atoi(port)
	ud, err := guest.UserData(guest.Config{Users: []guest.User{{Name: "probe", Password: "pw"}},
		AllowedDestinations: []guest.Destination{{Ports: []int{portN}}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	inst, err := p.Create(ctx, egressproxy.Spec{Name: "proxy-a", UID: "uid-a", UserData: ud})
	if err != nil {
		t.Fatal(err)
	}

	opts := health.ProbeOptions{Username: "probe", Password: "pw", Exchange: health.HTTPGet(target, body)}
	if res := health.Probe(ctx, inst.Address(), target, &opts); !res.OK {
		t.Fatalf("probe with credentials: %v (status %d)", res.Err, res.StatusCode)
	}

	res := health.ProbeAll(ctx, []health.Proxy{{ID: inst.Name, Address: inst.Address(), Target: target}}, nil)
	if len(res) != 1 || res[0].OK || res[0].Kind != health.KindAuthRequired || res[0].ID != "proxy-a" {
		t.Fatalf("probe without credentials: %+v, want one auth-required result for proxy-a", res)
	}

	// One round, each proxy with credentials of its own: the right ones
	// get through, the wrong ones get 407, and a proxy without any takes
	// the round's (here: none).
	good := health.Proxy{ID: "good", Address: inst.Address(), Target: target, Username: "probe", Password: "pw"}
	wrong := health.Proxy{ID: "wrong", Address: inst.Address(), Target: target, Username: "probe", Password: "not-pw"}
	none := health.Proxy{ID: "none", Address: inst.Address(), Target: target}
	res = health.ProbeAll(ctx, []health.Proxy{good, wrong, none}, &health.ProbeAllOptions{Probe: health.ProbeOptions{Exchange: health.HTTPGet(target, body)}})
	if len(res) != 3 || !res[0].OK || res[1].Kind != health.KindAuthRequired || res[2].Kind != health.KindAuthRequired {
		t.Fatalf("one round with per-proxy credentials: %+v, want good OK, wrong and none auth-required", res)
	}
	// The round's credentials stand in for a proxy without its own.
	res = health.ProbeAll(ctx, []health.Proxy{none, wrong}, &health.ProbeAllOptions{Probe: health.ProbeOptions{Username: "probe", Password: "pw", Exchange: health.HTTPGet(target, body)}})
	if len(res) != 2 || !res[0].OK || res[1].Kind != health.KindAuthRequired {
		t.Fatalf("round credentials with a proxy's own wrong ones: %+v, want none OK (round's), wrong auth-required (its own win)", res)
	}
	// Tracker.Round passes a proxy's credentials to its probe.
	tr, err := health.NewTracker(&health.TrackerOptions{Rise: 1, Fall: 1})
	if err != nil {
		t.Fatal(err)
	}
	res, err = tr.Round(ctx, []health.Proxy{{ID: "good", Address: inst.Address(), Username: "probe", Password: "pw"}, {ID: "wrong", Address: inst.Address(), Username: "probe", Password: "x"}},
		&health.ProbeAllOptions{Target: target, Probe: health.ProbeOptions{Exchange: health.HTTPGet(target, body)}})
	if err != nil || len(res) != 2 || !res[0].OK || res[1].Kind != health.KindAuthRequired {
		t.Fatalf("Tracker.Round with each proxy's credentials: %+v, %v", res, err)
	}
	if st, _ := tr.Get("good"); st.State != health.StateHealthy {
		t.Errorf("member with the right credentials: %v, want healthy", st.State)
	}
}
