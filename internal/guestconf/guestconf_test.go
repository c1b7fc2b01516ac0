package guestconf

import (
	"net/http"
	"net/netip"
	"strings"
	"testing"
)

func conf(lines ...string) string {
	return "#cloud-config\n" + Marker + "\nwrite_files:\n- path: " + SquidConf + "\n  content: |\n    " + strings.Join(lines, "\n    ") + "\n"
}

// Parse takes only the contract's Squid configuration: anything it could
// not model is refused, naming the line.
func TestParseRefuses(t *testing.T) {
	for _, tt := range []struct {
		name, ud, want string
	}{
		{"unknown directive", conf("http_port 3128", "always_direct allow all"), `line 2: directive "always_direct"`},
		{"unknown acl type", conf("http_port 3128", "acl x dst 10.0.0.0/8"), `acl type "dst"`},
		{"dstdomain without -n", conf("http_port 3128", "acl x dstdomain .example.com"), "without -n"},
		{"undefined acl", conf("http_port 3128", "http_access allow nope"), `undefined acl "nope"`},
		{"no port", conf("acl x port 443"), "no http_port"},
		{"two ports", conf("http_port 3128", "http_port 3129"), "second listening port"},
		{"https_port elsewhere", conf("https_port 3128 tls-cert=/tmp/c tls-key=/tmp/k"), "must name"},
		{"method other than CONNECT", conf("http_port 3128", "acl m method GET"), `method "GET"`},
		{"redefined type", conf("http_port 3128", "acl x port 443", "acl x src 10.0.0.0/8"), "redefined"},
		{"auth elsewhere", conf("http_port 3128", "auth_param basic program /bin/true /etc/passwd"), "auth_param must be"},
		{"proxy_auth without helper", conf("http_port 3128", "acl u proxy_auth REQUIRED", "http_access deny !u"), "without an auth_param"},
		{"no squid.conf", "#cloud-config\n" + Marker + "\nwrite_files: []\n", "writes no"},
		{"not YAML", "#cloud-config\n" + Marker + "\n\t:", "not the cloud-config"},
		{"unknown key", "#cloud-config\n" + Marker + "\nruncmd: [reboot]\n", "not the cloud-config"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, ok, err := Parse(tt.ud)
			if !ok || err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Parse: ok %v, %v; want an error containing %q", ok, err, tt.want)
			}
		})
	}
	if _, ok, err := Parse("#cloud-config\nwrite_files: []\n"); ok || err != nil {
		t.Errorf("user-data without the marker: ok %v, %v; want not ours", ok, err)
	}
}

// Decide follows Squid's reading of http_access: first matching line wins,
// every ACL of a line must match (negation included), no match is the
// opposite of the last line, an authentication ACL without valid
// credentials ends the check with 407.
func TestDecideSquidRules(t *testing.T) {
	c, ok, err := Parse(conf("http_port 3128",
		"acl c method CONNECT", "acl lan src 10.0.0.0/8 192.0.2.7", "acl web port 80 8000-8080", "acl ex dstdomain -n .example.com exact.org",
		"http_access deny !c", "http_access allow lan web", "http_access allow ex", "http_access deny web"))
	if !ok || err != nil {
		t.Fatal(ok, err)
	}
	for _, tt := range []struct {
		client, method, host string
		port, want           int
	}{
		{"10.1.1.1", "CONNECT", "192.0.2.1", 8000, http.StatusOK},
		{"10.1.1.1", "GET", "192.0.2.1", 8000, http.StatusForbidden},
		{"192.0.2.7", "CONNECT", "192.0.2.1", 80, http.StatusOK},
		{"192.0.2.8", "CONNECT", "192.0.2.1", 80, http.StatusForbidden},      // deny web
		{"192.0.2.8", "CONNECT", "192.0.2.1", 22, http.StatusOK},             // no line: the last one's opposite
		{"192.0.2.8", "CONNECT", "www.example.com", 80, http.StatusOK},       // allow ex first
		{"192.0.2.8", "CONNECT", "EXAMPLE.com", 80, http.StatusOK},           // case
		{"192.0.2.8", "CONNECT", "badexample.com", 80, http.StatusForbidden}, // not a suffix at a dot
		{"192.0.2.8", "CONNECT", "www.exact.org", 80, http.StatusForbidden},  // exact only
		{"192.0.2.8", "CONNECT", "exact.org", 80, http.StatusOK},             // exact
		{"::ffff:10.0.0.1", "CONNECT", "192.0.2.1", 8080, http.StatusOK},     // a mapped client is its IPv4 address
		{"10.0.0.1", "CONNECT", "192.0.2.1", 8081, http.StatusOK},            // no line matches; the last denies
		{"192.0.2.8", "CONNECT", "192.0.2.1", 8080, http.StatusForbidden},    // deny web
	} {
		got := c.Decide(Request{Client: netip.MustParseAddr(tt.client), Method: tt.method, Host: tt.host, Port: tt.port})
		if got != tt.want {
			t.Errorf("%s %s:%d from %s: %d, want %d", tt.method, tt.host, tt.port, tt.client, got, tt.want)
		}
	}
}
