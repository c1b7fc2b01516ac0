package sshconn

import (
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"github.com/google/go-cmp/cmp"
	"golang.org/x/crypto/ssh"
	"sigs.k8s.io/yaml"
)

// fullConfig sets every marshalled field of Config to a value other than
// its zero (TestFullConfigsAreFull keeps it so when fields are added). It
// need not be valid: KeyFile and AgentSocket, KnownHostsFile and
// KnownHosts are both set.
func fullConfig() Config {
	return Config{
		Address:           "hv1.example.net:2222",
		User:              "egressproxy",
		KeyFile:           "/etc/egressproxy/id_ed25519",
		AgentSocket:       "/run/egressproxy/agent.sock",
		KnownHostsFile:    "/etc/egressproxy/known_hosts",
		KnownHosts:        []byte("[hv1.example.net]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"),
		DialTimeout:       15 * time.Second,
		KeepaliveInterval: 10 * time.Second,
		KeepaliveCount:    5,
		MaxRedialBackoff:  90 * time.Second,
	}
}

// fullDurations is how fullConfig's durations are written.
var fullDurations = map[string]string{
	"dialTimeout": "15s", "keepaliveInterval": "10s", "maxRedialBackoff": "1m30s",
}

// configCmp compares configs.
var configCmp = cmp.Options{}

// jsonNames returns the JSON names of t's marshalled fields.
func jsonNames(t reflect.Type) map[string]string {
	names := map[string]string{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "-" {
			names[name] = f.Name
		}
	}
	return names
}

func TestFullConfigsAreFull(t *testing.T) {
	t.Parallel()
	for _, c := range []any{fullConfig()} {
		v := reflect.ValueOf(c)
		for i := 0; i < v.NumField(); i++ {
			f := v.Type().Field(i)
			if f.Tag.Get("json") != "-" && v.Field(i).IsZero() {
				t.Errorf("the fixture leaves %s.%s zero; set it so the round-trip tests cover it", v.Type().Name(), f.Name)
			}
		}
	}
}

// Every field is tagged, Kubernetes style: camelCase, the field's name up
// to case, no two alike; durations are time.Duration (MarshalJSON writes
// them as strings); secrets are hidden.
func TestConfigTags(t *testing.T) {
	t.Parallel()
	hidden := map[string]bool{"Key": true, "KeyPassphrase": true}
	for _, typ := range []reflect.Type{reflect.TypeFor[Config]()} {
		seen := map[string]bool{}
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			tag, ok := f.Tag.Lookup("json")
			if !ok {
				t.Errorf("%s.%s has no json tag", typ.Name(), f.Name)
				continue
			}
			if strings.HasSuffix(f.Name, "Timeout") || strings.HasSuffix(f.Name, "Interval") || strings.HasSuffix(f.Name, "Backoff") {
				if f.Type != reflect.TypeFor[time.Duration]() {
					t.Errorf("%s.%s is a %v, want time.Duration", typ.Name(), f.Name, f.Type)
				}
			}
			name, _, _ := strings.Cut(tag, ",")
			if (name == "-") != hidden[f.Name] {
				t.Errorf("%s.%s: tag %q; only the secrets are `json:\"-\"`", typ.Name(), f.Name, tag)
			}
			if name == "-" {
				continue
			}
			if name == "" || !unicode.IsLower(rune(name[0])) || strings.ContainsAny(name, "_- ") {
				t.Errorf("%s.%s: json name %q is not camelCase", typ.Name(), f.Name, name)
			}
			if !strings.EqualFold(name, f.Name) {
				t.Errorf("%s.%s: json name %q differs from the field name beyond case", typ.Name(), f.Name, name)
			}
			if seen[name] {
				t.Errorf("%s: json name %q twice", typ.Name(), name)
			}
			seen[name] = true
		}
	}
}

// roundTrip marshals want to JSON and YAML, reads both back strictly into
// a new value of its type and compares; every marshalled field is in the
// output and durations are strings.
func roundTrip[T any](t *testing.T, want T) {
	t.Helper()
	j, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	var fromJSON T
	dec := json.NewDecoder(strings.NewReader(string(j)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&fromJSON); err != nil {
		t.Fatalf("decode %s: %v", j, err)
	}
	if d := cmp.Diff(want, fromJSON, configCmp); d != "" {
		t.Errorf("JSON round trip (-want +got):\n%s\n%s", d, j)
	}
	var m map[string]any
	if err := json.Unmarshal(j, &m); err != nil {
		t.Fatal(err)
	}
	names := jsonNames(reflect.TypeFor[T]())
	for name := range names {
		if _, ok := m[name]; !ok {
			t.Errorf("marshalled %T lacks %q: %s", want, name, j)
		}
	}
	if len(m) != len(names) {
		t.Errorf("marshalled %T has %d keys, want %d: %s", want, len(m), len(names), j)
	}
	for name, v := range fullDurations {
		if _, ok := names[name]; ok && m[name] != v {
			t.Errorf("%s = %#v, want %q", name, m[name], v)
		}
	}

	y, err := yaml.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	var fromYAML T
	if err := yaml.UnmarshalStrict(y, &fromYAML); err != nil {
		t.Fatalf("UnmarshalStrict:\n%s\n%v", y, err)
	}
	if d := cmp.Diff(want, fromYAML, configCmp); d != "" {
		t.Errorf("YAML round trip (-want +got):\n%s\n%s", d, y)
	}
	for name, v := range fullDurations {
		if _, ok := names[name]; ok && !strings.Contains("\n"+string(y), "\n"+name+": "+v+"\n") {
			t.Errorf("YAML does not write %s as %q:\n%s", name, v, y)
		}
	}
}

func TestConfigRoundTrip(t *testing.T) {
	t.Parallel()
	roundTrip(t, fullConfig())
}

// A config file written by hand, as an adopter would, gives the same
// values; a bare number for a duration is refused, naming the field.
func TestConfigYAMLByHand(t *testing.T) {
	t.Parallel()
	const doc = `
address: hv1.example.net:2222
user: egressproxy
keyFile: /etc/egressproxy/id_ed25519
agentSocket: /run/egressproxy/agent.sock
knownHostsFile: /etc/egressproxy/known_hosts
knownHosts: W2h2MS5leGFtcGxlLm5ldF06MjIyMiBzc2gtZWQyNTUxOSBBQUFBQzNOemFDMWxaREkxTlRFNUFBQUFJT01xcW5rVnpybTBTZEc2VU9vcUtMc2FiZ0g1Qzlva1dpMGRoMmw5R0tKbAo=
dialTimeout: 15s
keepaliveInterval: 10s
keepaliveCount: 5
maxRedialBackoff: 90s
`
	var got Config
	if err := yaml.UnmarshalStrict([]byte(doc), &got); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(fullConfig(), got, configCmp); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
	err := yaml.UnmarshalStrict([]byte("dialTimeout: 30\n"), &got)
	if err == nil || !strings.Contains(err.Error(), "dialTimeout") || !strings.Contains(err.Error(), "nanoseconds") {
		t.Errorf("bare number: %v, want an error naming dialTimeout", err)
	}
}

// Zero values mean "the default" and are left out; the required fields are
// always written.
func TestConfigMarshalZero(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		v    any
		want string
	}{{Config{}, `{"address":"","user":""}`}} {
		b, err := json.Marshal(tc.v)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != tc.want {
			t.Errorf("Marshal(%T{}) = %s, want %s", tc.v, b, tc.want)
		}
	}
}

// A Config holding a real key and a passphrase marshals (JSON, YAML) with
// none of their content, and String, GoString and every fmt verb still
// redact them.
func TestConfigMarshalNoSecrets(t *testing.T) {
	t.Parallel()
	const pass = "pass-" + secretMarker
	blk, err := ssh.MarshalPrivateKey(sshtest.GenEd25519(t), "")
	if err != nil {
		t.Fatal(err)
	}
	key := pem.EncodeToMemory(blk)
	c := fullConfig()
	c.Key, c.KeyPassphrase = key, []byte(pass)

	pemBody := strings.TrimSpace(string(key))
	pemBody = pemBody[strings.Index(pemBody, "\n")+1 : strings.LastIndex(pemBody, "\n")]
	secrets := map[string]string{
		"key PEM":           string(key),
		"key body line":     strings.Split(pemBody, "\n")[0],
		"key as base64":     base64.StdEncoding.EncodeToString(key)[:40],
		"passphrase":        pass,
		"passphrase base64": base64.StdEncoding.EncodeToString([]byte(pass)),
		"PEM armour":        "BEGIN",
	}
	j, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	y, err := yaml.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	outs := map[string]string{
		"json": string(j), "yaml": string(y),
		"String": c.String(), "GoString": c.GoString(),
		"%v": fmt.Sprintf("%v", c), "%+v": fmt.Sprintf("%+v", c), "%#v": fmt.Sprintf("%#v", c), "%s %q": fmt.Sprintf("%s %q", c, c),
		"pointer %v": fmt.Sprintf("%v", &c), "pointer %+v": fmt.Sprintf("%+v", &c),
	}
	for name, out := range outs {
		for what, s := range secrets {
			if strings.Contains(out, s) {
				t.Errorf("%s carries the %s:\n%s", name, what, out)
			}
		}
	}
	var m map[string]any
	if err := json.Unmarshal(j, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"key", "keyPassphrase", "Key", "KeyPassphrase"} {
		if _, ok := m[k]; ok {
			t.Errorf("marshalled config has %q: %s", k, j)
		}
	}
	// The marshalled config is the fixture without them: nothing else lost.
	var back Config
	if err := json.Unmarshal(j, &back); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(fullConfig(), back, configCmp); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
	if s := c.String(); !strings.Contains(s, fmt.Sprintf("Key: [redacted, %d bytes]", len(key))) ||
		!strings.Contains(s, "KeyPassphrase: [redacted]") ||
		!strings.Contains(s, "DialTimeout: 15s") || !strings.Contains(s, "MaxRedialBackoff: 1m30s") {
		t.Errorf("String does not name the key sources and durations: %s", s)
	}
}
