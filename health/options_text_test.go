package health

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
)

// The structs holding a proxy password print without it, through String
// and every fmt verb, by value and by pointer (an embedder logging its
// options, or a %+v in an error, must not leak the Secret), and still show
// the plain values.
func TestOptionsTextHasNoSecret(t *testing.T) {
	t.Parallel()
	const password = "pr0xy-passw0rd"
	probe := ProbeOptions{Timeout: 3 * time.Second, Username: "probe", Password: password, TLS: &tls.Config{},
		Exchange: func(context.Context, net.Conn) error { return nil }, DialContext: (&net.Dialer{}).DialContext}
	all := ProbeAllOptions{Workers: 8, Target: "example.com:443", Probe: probe, Logger: funcr.New(func(string, string) {}, funcr.Options{})}
	proxy := Proxy{ID: "p1", Address: "10.0.0.5:3128", Username: "probe", Password: password}
	for name, v := range map[string]any{"ProbeOptions": probe, "*ProbeOptions": &probe, "ProbeAllOptions": all, "*ProbeAllOptions": &all,
		"Proxy": proxy, "*Proxy": &proxy} {
		for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q"} {
			out := fmt.Sprintf(verb, v)
			if strings.Contains(out, password) {
				t.Errorf("%s with %s shows the password: %s", name, verb, out)
			}
			if !strings.Contains(out, "probe") || !strings.Contains(out, "REDACTED") {
				t.Errorf("%s with %s lacks the username or the redacted password: %s", name, verb, out)
			}
		}
	}
	for _, tt := range []struct{ got, want string }{
		{probe.String(), `{Timeout:3s Username:"probe" Password:REDACTED TLS:set Exchange:set DialContext:set}`},
		{all.String(), `{Workers:8 Target:"example.com:443" Probe:{Timeout:3s Username:"probe" Password:REDACTED TLS:set Exchange:set DialContext:set} Logger:set}`},
		{proxy.GoString(), `health.Proxy{ID:"p1" Address:"10.0.0.5:3128" Username:"probe" Password:REDACTED}`},
		{ProbeOptions{}.String(), `{}`},
		{ProbeAllOptions{}.String(), `{}`},
	} {
		if tt.got != tt.want {
			t.Errorf("got  %s\nwant %s", tt.got, tt.want)
		}
	}
}
