package controller

import (
	"context"
	"net"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"

	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
	"github.com/egressproxy/egressproxy/memprovider"
)

// editSpec changes the fixture's object before its first reconcile.
func (f *fixture) editSpec(t *testing.T, edit func(*v1alpha1.EgressProxySpec)) {
	t.Helper()
	var ep v1alpha1.EgressProxy
	if err := f.c.Get(context.Background(), f.key, &ep); err != nil {
		t.Fatal(err)
	}
	edit(&ep.Spec)
	if err := f.c.Update(context.Background(), &ep); err != nil {
		t.Fatal(err)
	}
}

func portsOf(t *testing.T, addrs ...string) []int32 {
	t.Helper()
	var ps []int32
	for _, a := range addrs {
		_, p, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(p)
		ps = append(ps, int32(n))
	}
	return ps
}

// TestClosedByDefault: an object that restricts its proxy neither by
// credentials nor by client ranges is refused unless it says open; open
// beside a restriction is refused too; a bad range is named by its field.
func TestClosedByDefault(t *testing.T) {
	for _, tc := range []struct {
		name       string
		edit       func(*v1alpha1.EgressProxySpec)
		wantReason string
		wantMsg    string
	}{
		{"neither credentials nor clients", func(s *v1alpha1.EgressProxySpec) { s.CredentialsSecretRef = nil },
			ReasonProxyConfigInvalid, "set credentialsSecretRef or allowedClients, or open: true"},
		{"open with credentials", func(s *v1alpha1.EgressProxySpec) { s.Open = true },
			ReasonProxyConfigInvalid, "spec.open must be false"},
		{"a range with host bits", func(s *v1alpha1.EgressProxySpec) { s.AllowedClients = []string{"10.0.0.1/8"} },
			ReasonProxyConfigInvalid, "spec.allowedClients[0]"},
		{"a destination port out of range", func(s *v1alpha1.EgressProxySpec) {
			s.AllowedDestinations = []v1alpha1.Destination{{Ports: []int32{70000}}}
		}, ReasonProxyConfigInvalid, "spec.allowedDestinations[0].ports"},
		{"open, said so", func(s *v1alpha1.EgressProxySpec) { s.CredentialsSecretRef, s.Open = nil, true }, "Running", ""},
		{"clients only", func(s *v1alpha1.EgressProxySpec) {
			s.CredentialsSecretRef, s.AllowedClients = nil, []string{"192.0.2.0/24"}
		}, "Running", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, nil)
			f.editSpec(t, tc.edit)
			_, ep := f.reconcile(t)
			if got := readyReason(ep); got != tc.wantReason {
				t.Fatalf("Ready reason %q, want %q (phase %q)", got, tc.wantReason, ep.Status.Phase)
			}
			if tc.wantMsg == "" {
				return
			}
			c := ep.Status.Conditions[0]
			for _, cc := range ep.Status.Conditions {
				if cc.Type == v1alpha1.ConditionReady {
					c = cc
				}
			}
			if !strings.Contains(c.Message, tc.wantMsg) || ep.Status.Phase != v1alpha1.PhasePending {
				t.Errorf("phase %q, Ready message %q: want Pending and a message naming %q", ep.Status.Phase, c.Message, tc.wantMsg)
			}
			if list, err := f.mem.List(context.Background()); err != nil || len(list) != 0 {
				t.Errorf("instances %v (err %v): want none for a refused object", list, err)
			}
		})
	}
}

// TestUserDataStableAndSecretFree: the same object renders the same
// user-data (a stable spec digest), a new password other user-data, and
// the password is never in it.
func TestUserDataStableAndSecretFree(t *testing.T) {
	f := newFixture(t, nil)
	var ep v1alpha1.EgressProxy
	if err := f.c.Get(context.Background(), f.key, &ep); err != nil {
		t.Fatal(err)
	}
	a, err := f.r.proxyConfig(context.Background(), &ep)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := f.r.proxyConfig(context.Background(), &ep)
	if a.userData != b.userData {
		t.Error("the same object rendered two user-data")
	}
	if strings.Contains(a.userData, "p1\n") || strings.Contains(a.userData, ":p1") {
		t.Errorf("the user-data holds the password:\n%s", a.userData)
	}
	var sec corev1.Secret
	if err := f.c.Get(context.Background(), f.keyOf("creds"), &sec); err != nil {
		t.Fatal(err)
	}
	sec.Data["password"] = []byte("p2")
	if err := f.c.Update(context.Background(), &sec); err != nil {
		t.Fatal(err)
	}
	c, _ := f.r.proxyConfig(context.Background(), &ep)
	if c.userData == a.userData {
		t.Error("a new password rendered the same user-data")
	}
}

func (f *fixture) keyOf(name string) types.NamespacedName {
	return types.NamespacedName{Namespace: f.key.Namespace, Name: name}
}

// TestEgressAddressEvent: through a served proxy with TLS from a Secret,
// the probes learn the egress address the echo server reports; it is in
// the object's status, and a change of it is exactly one event.
func TestEgressAddressEvent(t *testing.T) {
	f := newFixture(t, &memprovider.Options{ServeProxies: true})
	target := listenTarget(t)
	echo := guesttest.ServeEcho(t, "127.0.0.1")
	pair := guesttest.NewTLS(t)
	tlsSec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: f.key.Namespace, Name: "proxy-tls"}, Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{SecretKeyTLSCert: []byte(pair.CertPEM), SecretKeyTLSKey: []byte(pair.KeyPEM)}}
	if err := f.c.Create(context.Background(), tlsSec); err != nil {
		t.Fatal(err)
	}
	f.editSpec(t, func(s *v1alpha1.EgressProxySpec) {
		s.AllowedClients = []string{"127.0.0.1"}
		s.AllowedDestinations = []v1alpha1.Destination{{Ports: portsOf(t, target, echo.Addr)}}
		s.TLSSecretRef = &v1alpha1.SecretReference{Name: "proxy-tls"}
	})
	rec := events.NewFakeRecorder(10)
	f.hr.opts.ConnectTarget, f.hr.opts.EgressURL, f.hr.opts.Events = target, echo.URL, rec
	_, ep := f.reconcile(t)
	if ep.Status.Address == "" {
		t.Fatalf("no address after create: %+v", ep.Status)
	}
	for range 2 { // the tracker's default Rise
		f.hr.Round(context.Background())
	}
	_, ep = f.reconcile(t)
	if ep.Status.Health != v1alpha1.HealthHealthy || ep.Status.EgressAddress != "127.0.0.1" {
		t.Fatalf("health %q egress %q, want Healthy and 127.0.0.1 (the probes must pass TLS, clients and destinations)", ep.Status.Health, ep.Status.EgressAddress)
	}
	if n := len(rec.Events); n != 0 {
		t.Fatalf("%d events for the first address learned, want none: %s", n, <-rec.Events)
	}
	echo.Report("192.0.2.44")
	for range 3 {
		f.hr.Round(context.Background())
	}
	_, ep = f.reconcile(t)
	if ep.Status.EgressAddress != "192.0.2.44" {
		t.Errorf("egress %q after the change, want 192.0.2.44", ep.Status.EgressAddress)
	}
	if n := len(rec.Events); n != 1 {
		t.Fatalf("%d events after one change, want exactly 1", n)
	}
	e := <-rec.Events
	if !strings.Contains(e, ReasonEgressAddressChanged) || !strings.Contains(e, "from 127.0.0.1 to 192.0.2.44") {
		t.Errorf("event %q: want reason %s naming both addresses", e, ReasonEgressAddressChanged)
	}
}
