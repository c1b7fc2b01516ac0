package guest_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/GehirnInc/crypt/sha512_crypt"
	"go.yaml.in/yaml/v3"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/guest"
	"github.com/egressproxy/egressproxy/internal/testing/guesttest"
)

const secret = "s3cret-Pa55word"

func users() []guest.User { return []guest.User{{Name: "alice", Password: secret}} }

func TestValidate(t *testing.T) {
	pair := guesttest.NewTLS(t)
	other := guesttest.NewTLS(t)
	rsaKey, _ := rsa.GenerateKey(rand.Reader, 1024)
	smallRSA := string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(rsaKey)}))
	p224, _ := ecdsa.GenerateKey(elliptic.P224(), rand.Reader)
	p224DER, _ := x509.MarshalECPrivateKey(p224)
	p224Key := string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: p224DER}))
	tests := []struct {
		name   string
		c      guest.Config
		fields []string // the FieldErrors' fields, in order; nil: valid
	}{
		{"users only", guest.Config{Users: users()}, nil},
		{"clients only", guest.Config{AllowedClients: []string{"10.0.0.0/8", "192.0.2.7", "2001:db8::/32", "::1"}}, nil},
		{"open", guest.Config{Open: true}, nil},
		{"everything", guest.Config{Port: 8080, Users: users(), AllowedClients: []string{"10.0.0.0/8"},
			AllowedDestinations: []guest.Destination{{Ports: []int{443, 8443}, Domains: []string{"example.com", "API.Example.org"}}, {}},
			TLS:                 &guest.TLS{Certificate: pair.CertPEM, Key: pair.KeyPEM}}, nil},
		{"zero value: closed by default", guest.Config{}, []string{"Users"}},
		{"open and restricted", guest.Config{Open: true, Users: users()}, []string{"Open"}},
		{"open and clients", guest.Config{Open: true, AllowedClients: []string{"10.0.0.0/8"}}, []string{"Open"}},
		{"port", guest.Config{Open: true, Port: 65536}, []string{"Port"}},
		{"negative port", guest.Config{Open: true, Port: -1}, []string{"Port"}},
		{"user names", guest.Config{Users: []guest.User{{Name: "", Password: "x"}, {Name: "a:b", Password: "x"}, {Name: "bob", Password: "x"}, {Name: "bob", Password: "y"}, {Name: strings.Repeat("a", 65), Password: "x"}}},
			[]string{"Users[0].Name", "Users[1].Name", "Users[3].Name", "Users[4].Name"}},
		{"passwords", guest.Config{Users: []guest.User{{Name: "a"}, {Name: "b", Password: "line\nbreak"}, {Name: "c", Password: strings.Repeat("x", 257)}}},
			[]string{"Users[0].Password", "Users[1].Password", "Users[2].Password"}},
		{"clients", guest.Config{AllowedClients: []string{"10.0.0.1/8", "10.0.0.0/33", "example.com", "", "::ffff:10.0.0.0/104", "fe80::1%eth0"}},
			[]string{"AllowedClients[0]", "AllowedClients[1]", "AllowedClients[2]", "AllowedClients[3]", "AllowedClients[4]", "AllowedClients[5]"}},
		{"destinations", guest.Config{Open: true, AllowedDestinations: []guest.Destination{
			{Ports: []int{0, 443, 70000}},
			{Domains: []string{".example.com", "*.example.com", "exa mple.com", "192.0.2.1", "-x.com", strings.Repeat("a", 64) + ".com", ""}}}},
			[]string{"AllowedDestinations[0].Ports[0]", "AllowedDestinations[0].Ports[2]",
				"AllowedDestinations[1].Domains[0]", "AllowedDestinations[1].Domains[1]", "AllowedDestinations[1].Domains[2]", "AllowedDestinations[1].Domains[3]",
				"AllowedDestinations[1].Domains[4]", "AllowedDestinations[1].Domains[5]", "AllowedDestinations[1].Domains[6]"}},
		{"TLS, key of another certificate", guest.Config{Open: true, TLS: &guest.TLS{Certificate: pair.CertPEM, Key: other.KeyPEM}}, []string{"TLS.Key"}},
		{"TLS, no certificate", guest.Config{Open: true, TLS: &guest.TLS{Certificate: "", Key: pair.KeyPEM}}, []string{"TLS.Certificate"}},
		{"TLS, key as certificate", guest.Config{Open: true, TLS: &guest.TLS{Certificate: pair.KeyPEM, Key: pair.KeyPEM}}, []string{"TLS.Certificate"}},
		{"TLS, certificate and junk", guest.Config{Open: true, TLS: &guest.TLS{Certificate: pair.CertPEM + "junk", Key: pair.KeyPEM}}, []string{"TLS.Certificate"}},
		{"TLS, two keys", guest.Config{Open: true, TLS: &guest.TLS{Certificate: pair.CertPEM, Key: pair.KeyPEM + pair.KeyPEM}}, []string{"TLS.Key"}},
		{"TLS, weak keys", guest.Config{Open: true, TLS: &guest.TLS{Certificate: pair.CertPEM, Key: smallRSA}}, []string{"TLS.Key"}},
		{"TLS, P-224", guest.Config{Open: true, TLS: &guest.TLS{Certificate: pair.CertPEM, Key: p224Key}}, []string{"TLS.Key"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.c.Validate()
			var got []string
			for _, fe := range egressproxy.FieldErrors(err) {
				got = append(got, fe.Field)
			}
			if !slices.Equal(got, tt.fields) {
				t.Fatalf("Validate: fields %q, want %q (%v)", got, tt.fields, err)
			}
			if err == nil {
				if _, err := guest.UserData(tt.c, nil); err != nil {
					t.Fatalf("UserData of a valid config: %v", err)
				}
				return
			}
			if egressproxy.Code(err) != egressproxy.Permanent {
				t.Errorf("class %v, want Permanent", egressproxy.Code(err))
			}
			text := err.Error()
			for _, s := range []string{secret, "line\nbreak", "PRIVATE KEY", pair.KeyPEM[40:80], other.KeyPEM[40:80]} {
				if strings.Contains(text, s) {
					t.Errorf("the error quotes a secret (%q):\n%s", s, text)
				}
			}
			if _, uerr := guest.UserData(tt.c, nil); uerr == nil || uerr.Error() != text {
				t.Errorf("UserData's error %v, want Validate's", uerr)
			}
		})
	}
}

// files parses user-data's write_files, checking it is cloud-config.
func files(t *testing.T, ud string) map[string]writeFile {
	t.Helper()
	if !strings.HasPrefix(ud, "#cloud-config\n") {
		t.Fatalf("user-data does not start with #cloud-config:\n%s", ud)
	}
	var cc struct {
		WriteFiles []writeFile `yaml:"write_files"`
	}
	dec := yaml.NewDecoder(strings.NewReader(ud))
	dec.KnownFields(true)
	if err := dec.Decode(&cc); err != nil {
		t.Fatalf("user-data is not YAML: %v\n%s", err, ud)
	}
	out := map[string]writeFile{}
	for _, f := range cc.WriteFiles {
		out[f.Path] = f
	}
	return out
}

type writeFile struct {
	Path, Owner, Permissions, Content string
}

// The password is stored hashed (a hash that verifies it and nothing
// else), the secrets' files are readable by Squid's group only, the same
// Salt gives the same user-data and another password or Salt another.
func TestUserDataFiles(t *testing.T) {
	pair := guesttest.NewTLS(t)
	c := guest.Config{Port: 8080, Users: users(), AllowedClients: []string{"10.0.0.0/8"}, TLS: &guest.TLS{Certificate: pair.CertPEM, Key: pair.KeyPEM}}
	ud, err := guest.UserData(c, &guest.UserDataOptions{Salt: "uid-1"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(ud, secret) {
		t.Fatalf("user-data holds the password in clear")
	}
	fs := files(t, ud)
	want := map[string][2]string{
		"/etc/squid/squid.conf":    {"root:root", "0644"},
		"/etc/squid/passwd":        {"root:proxy", "0640"},
		"/etc/squid/tls/proxy.crt": {"root:root", "0644"},
		"/etc/squid/tls/proxy.key": {"root:proxy", "0640"},
	}
	if len(fs) != len(want) {
		t.Fatalf("files %v, want %v", fs, want)
	}
	for p, w := range want {
		if f := fs[p]; f.Owner != w[0] || f.Permissions != w[1] {
			t.Errorf("%s: owner %q permissions %q, want %s %s", p, f.Owner, f.Permissions, w[0], w[1])
		}
	}
	if !strings.Contains(fs["/etc/squid/squid.conf"].Content, "https_port 8080 tls-cert=/etc/squid/tls/proxy.crt tls-key=/etc/squid/tls/proxy.key\n") {
		t.Errorf("squid.conf does not serve TLS on 8080:\n%s", fs["/etc/squid/squid.conf"].Content)
	}
	user, hash, _ := strings.Cut(strings.TrimSpace(fs["/etc/squid/passwd"].Content), ":")
	if user != "alice" || !strings.HasPrefix(hash, "$6$") || sha512_crypt.New().Verify(hash, []byte(secret)) != nil || sha512_crypt.New().Verify(hash, []byte("wrong")) == nil {
		t.Errorf("passwd line %q: want alice and a SHA-512 crypt hash of the password only", fs["/etc/squid/passwd"].Content)
	}
	again, _ := guest.UserData(c, &guest.UserDataOptions{Salt: "uid-1"})
	otherSalt, _ := guest.UserData(c, &guest.UserDataOptions{Salt: "uid-2"})
	c2 := c
	c2.Users = []guest.User{{Name: "alice", Password: "rotated"}}
	rotated, _ := guest.UserData(c2, &guest.UserDataOptions{Salt: "uid-1"})
	random1, _ := guest.UserData(c, nil)
	random2, _ := guest.UserData(c, nil)
	if again != ud || otherSalt == ud || rotated == ud || random1 == random2 {
		t.Errorf("same salt same user-data %v, other salt differs %v, other password differs %v, random salts differ %v; want all true",
			again == ud, otherSalt != ud, rotated != ud, random1 != random2)
	}
	// The order of lists and duplicates change nothing.
	c3 := guest.Config{Port: 8080, Users: users(), AllowedClients: []string{"10.0.0.0/8", "10.1.0.0/16", "10.0.0.0/8"}, TLS: c.TLS}
	if same, _ := guest.UserData(c3, &guest.UserDataOptions{Salt: "uid-1"}); same != ud {
		t.Errorf("a range inside another and a duplicate change the user-data")
	}
}

// No password or key reaches String, GoString or any fmt verb.
func TestTextHasNoSecrets(t *testing.T) {
	pair := guesttest.NewTLS(t)
	c := guest.Config{Users: users(), TLS: &guest.TLS{Certificate: pair.CertPEM, Key: pair.KeyPEM}, AllowedDestinations: []guest.Destination{{Ports: []int{443}, Domains: []string{"example.com"}}}}
	keyBody := strings.Split(pair.KeyPEM, "\n")[1]
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q"} {
		for _, v := range []any{c, &c, c.Users[0], *c.TLS, c.TLS, []guest.User{c.Users[0]}} {
			s := fmt.Sprintf(verb, v)
			if strings.Contains(s, secret) || strings.Contains(s, keyBody) {
				t.Errorf("%s of %T shows a secret: %s", verb, v, s)
			}
		}
	}
	if s := c.String(); !strings.Contains(s, "REDACTED") || !strings.Contains(s, `"alice"`) || !strings.Contains(s, `"example.com"`) {
		t.Errorf("String %s: want the user's name, the domain and REDACTED", s)
	}
}
