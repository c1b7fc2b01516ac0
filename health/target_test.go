package health_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/memprovider"
)

func TestTargetFor(t *testing.T) {
	running := egressproxy.Instance{Ref: egressproxy.Ref{Name: "proxy-a", UID: "u"}, State: egressproxy.StateRunning, IP: "10.0.0.5", Port: 3128}
	v6 := running
	v6.IP = "fd00::5"
	for _, tc := range []struct {
		name           string
		inst           egressproxy.Instance
		target         string
		user, password string
		want           health.Target
		code           errs.ErrorCode
		field          string // the FieldError expected, if any
	}{
		{name: "running", inst: running, target: "example.com:443", user: "probe", password: "s3cret",
			want: health.Target{ID: "proxy-a", ProxyAddr: "10.0.0.5:3128", TargetAddr: "example.com:443", Username: "probe", Password: "s3cret"}},
		{name: "no credentials", inst: running, target: "example.com:443",
			want: health.Target{ID: "proxy-a", ProxyAddr: "10.0.0.5:3128", TargetAddr: "example.com:443"}},
		{name: "ipv6", inst: v6, target: "[fd00::1]:80",
			want: health.Target{ID: "proxy-a", ProxyAddr: "[fd00::5]:3128", TargetAddr: "[fd00::1]:80"}},
		{name: "provisioning", inst: egressproxy.Instance{Ref: running.Ref, State: egressproxy.StateProvisioning, Port: 3128}, target: "example.com:443", code: errs.Transient},
		{name: "stopped", inst: egressproxy.Instance{Ref: running.Ref, State: egressproxy.StateStopped, Port: 3128}, target: "example.com:443", code: errs.Permanent},
		{name: "failed", inst: egressproxy.Instance{Ref: running.Ref, State: egressproxy.StateFailed, Port: 3128}, target: "example.com:443", code: errs.Permanent},
		{name: "zero instance", target: "example.com:443", code: errs.Permanent},
		{name: "port zero", inst: egressproxy.Instance{Ref: running.Ref, State: egressproxy.StateRunning, IP: "10.0.0.5"}, target: "example.com:443", code: errs.Permanent, field: "Instance.Port"},
		{name: "target without port", inst: running, target: "example.com", code: errs.Permanent, field: "connectTarget"},
		{name: "target empty", inst: running, target: "", code: errs.Permanent, field: "connectTarget"},
		{name: "target with space", inst: running, target: "exa mple.com:443", code: errs.Permanent, field: "connectTarget"},
		{name: "user with colon", inst: running, target: "example.com:443", user: "a:b", password: "s3cret", code: errs.Permanent, field: "user"},
		{name: "password without user", inst: running, target: "example.com:443", password: "s3cret", code: errs.Permanent, field: "password"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, opts, err := health.TargetFor(tc.inst, tc.target, tc.user, tc.password)
			if c := errs.Code(err); c != tc.code {
				t.Fatalf("TargetFor: code %v (%v), want %v", c, err, tc.code)
			}
			if err != nil {
				if strings.Contains(err.Error(), "s3cret") {
					t.Errorf("error text contains the password: %v", err)
				}
				if tc.field != "" {
					var fe *errs.FieldError
					if !errors.As(err, &fe) || fe.Field != tc.field {
						t.Errorf("error %v: want a FieldError for %s", err, tc.field)
					}
				} else if !strings.Contains(err.Error(), "no address") {
					t.Errorf("error %q does not say the instance has no address", err)
				}
				return
			}
			if got != tc.want {
				t.Errorf("Target = %+v, want %+v", got, tc.want)
			}
			for _, text := range []string{fmt.Sprint(got), fmt.Sprintf("%+v", got), fmt.Sprintf("%#v", got)} {
				if tc.password != "" && strings.Contains(text, tc.password) {
					t.Errorf("the Target printed shows the password: %s", text)
				}
			}
			if opts.Username != tc.user || opts.Password != tc.password {
				t.Errorf("ProbeOptions credentials = %q/%q, want %q/%q", opts.Username, opts.Password, tc.user, tc.password)
			}
		})
	}
}

// A target from TargetFor probes a real proxy: memprovider serves one with
// basic auth on loopback; the right credentials get through, none get 407.
func TestTargetForProbesInstance(t *testing.T) {
	const body = "target ok"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, body) }))
	defer srv.Close()
	target := strings.TrimPrefix(srv.URL, "http://")

	p := memprovider.New(&memprovider.Options{ServeProxies: true, ProxyUser: "probe", ProxyPassword: "pw"})
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	inst, err := p.Create(ctx, egressproxy.Spec{Name: "proxy-a", UID: "uid-a"})
	if err != nil {
		t.Fatal(err)
	}

	tg, opts, err := health.TargetFor(inst, target, "probe", "pw")
	if err != nil {
		t.Fatal(err)
	}
	opts.Exchange = health.HTTPGet(target, body)
	if res := health.Probe(ctx, tg.ProxyAddr, tg.TargetAddr, &opts); !res.OK {
		t.Fatalf("probe with credentials: %v (status %d)", res.Err, res.StatusCode)
	}

	tg, opts, err = health.TargetFor(inst, target, "", "")
	if err != nil {
		t.Fatal(err)
	}
	res := health.ProbeAll(ctx, []health.Target{tg}, &health.ProbeAllOptions{Probe: opts})
	if len(res) != 1 || res[0].OK || res[0].Kind != health.KindAuthRequired || res[0].ID != "proxy-a" {
		t.Fatalf("probe without credentials: %+v, want one auth-required result for proxy-a", res)
	}

	// One round, each target with credentials of its own: the right ones
	// get through, the wrong ones get 407, and a target without any takes
	// the round's (here: none).
	good, _, _ := health.TargetFor(inst, target, "probe", "pw")
	wrong, _, _ := health.TargetFor(inst, target, "probe", "not-pw")
	none, _, _ := health.TargetFor(inst, target, "", "")
	good.ID, wrong.ID, none.ID = "good", "wrong", "none"
	res = health.ProbeAll(ctx, []health.Target{good, wrong, none}, &health.ProbeAllOptions{Probe: health.ProbeOptions{Exchange: health.HTTPGet(target, body)}})
	if len(res) != 3 || !res[0].OK || res[1].Kind != health.KindAuthRequired || res[2].Kind != health.KindAuthRequired {
		t.Fatalf("one round with per-target credentials: %+v, want good OK, wrong and none auth-required", res)
	}
	// The round's credentials stand in for a target without its own.
	res = health.ProbeAll(ctx, []health.Target{none, wrong}, &health.ProbeAllOptions{Probe: health.ProbeOptions{Username: "probe", Password: "pw", Exchange: health.HTTPGet(target, body)}})
	if len(res) != 2 || !res[0].OK || res[1].Kind != health.KindAuthRequired {
		t.Fatalf("round credentials with a target's own wrong ones: %+v, want none OK (round's), wrong auth-required (its own win)", res)
	}
	// Tracker.Round passes a member's credentials to its probe.
	tr, err := health.NewTracker(&health.TrackerOptions{Rise: 1, Fall: 1})
	if err != nil {
		t.Fatal(err)
	}
	res = tr.Round(ctx, []health.Member{{ID: "good", Addr: inst.Address(), Username: "probe", Password: "pw"}, {ID: "wrong", Addr: inst.Address(), Username: "probe", Password: "x"}},
		&health.ProbeAllOptions{TargetAddr: target, Probe: health.ProbeOptions{Exchange: health.HTTPGet(target, body)}})
	if len(res) != 2 || !res[0].OK || res[1].Kind != health.KindAuthRequired {
		t.Fatalf("Tracker.Round with member credentials: %+v", res)
	}
	if st, _ := tr.Get("good"); st.State != health.StateHealthy {
		t.Errorf("member with the right credentials: %v, want healthy", st.State)
	}
}
