package kvm2

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/google/go-cmp/cmp"
	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// fullConfig sets every marshalled field of Config to a value other than
// its zero (TestFullConfigIsFull keeps it so when fields are added). It
// need not be valid: Network and Bridge are both set.
func fullConfig() Config {
	return Config{
		Entry:          "lab-1",
		Owner:          "operator-a",
		Address:        "hv1.example.net:22",
		User:           "egressproxy",
		KeyFile:        "/etc/egressproxy/id_ed25519",
		KnownHostsFile: "/etc/egressproxy/known_hosts",
		AgentSocket:    "/run/egressproxy/agent.sock",
		KnownHosts:     []byte("hv1.example.net ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"),
		LibvirtSocket:  "/run/libvirt/libvirt-sock",
		LibvirtURI:     "qemu:///system",
		Pool:           "egressproxy",
		Images: map[string]imagecache.Image{
			"debian-12": {Key: "debian-12", URL: "https://images.example.net/debian-12.qcow2?v=3", SHA256: strings.Repeat("ab", 32), Format: "qcow2"},
			"alpine":    {URL: "http://mirror.example.net/alpine.raw", Format: "raw"},
		},
		DefaultImage:       "debian-12",
		TransferBudget:     30 * time.Minute,
		ClaimTimeout:       20 * time.Second,
		MachineTypes:       map[string]MachineType{"small": {VCPUs: 1, MemoryMiB: 512}, "large": {VCPUs: 4, MemoryMiB: 4096}},
		DefaultMachineType: "small",
		Network:            "default",
		Bridge:             "br0",
		DomainType:         "kvm",
		Kernel:             "/var/lib/egressproxy/vmlinuz",
		Initrd:             "/var/lib/egressproxy/initrd.img",
		Cmdline:            "console=ttyS0 root=/dev/vda1",
		ConsoleLogDir:      "/var/log/egressproxy",
		CallTimeout:        90 * time.Second,
		DialTimeout:        15 * time.Second,
		KeepaliveInterval:  10 * time.Second,
		KeepaliveCount:     5,
	}
}

// jsonFields returns the JSON names of t's marshalled fields, and the Go
// names of its fields tagged `json:"-"`.
func jsonFields(t reflect.Type) (names map[string]string, hidden []string) {
	names = map[string]string{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			hidden = append(hidden, f.Name)
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		names[name] = f.Name
	}
	return names, hidden
}

func TestFullConfigIsFull(t *testing.T) {
	t.Parallel()
	v := reflect.ValueOf(fullConfig())
	for i := 0; i < v.NumField(); i++ {
		f := v.Type().Field(i)
		if f.Tag.Get("json") != "-" && v.Field(i).IsZero() {
			t.Errorf("fullConfig leaves %s zero; set it so the round-trip tests cover it", f.Name)
		}
	}
}

// Every field is tagged, Kubernetes style: camelCase, no two alike.
func TestConfigTags(t *testing.T) {
	t.Parallel()
	for _, typ := range []reflect.Type{reflect.TypeFor[Config](), reflect.TypeFor[MachineType](), reflect.TypeFor[imagecache.Image]()} {
		seen := map[string]bool{}
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			tag, ok := f.Tag.Lookup("json")
			if !ok {
				t.Errorf("%s.%s has no json tag", typ.Name(), f.Name)
				continue
			}
			name, _, _ := strings.Cut(tag, ",")
			if name == "-" {
				continue
			}
			if name == "" || !unicode.IsLower(rune(name[0])) || strings.ContainsAny(name, "_- ") {
				t.Errorf("%s.%s: json name %q is not camelCase", typ.Name(), f.Name, name)
			}
			if !strings.EqualFold(name, f.Name) {
				t.Errorf("%s.%s: json name %q differs from the field name beyond case (docs/config.md maps them one to one)", typ.Name(), f.Name, name)
			}
			if seen[name] {
				t.Errorf("%s: json name %q twice", typ.Name(), name)
			}
			seen[name] = true
		}
	}
}

func TestConfigJSONRoundTrip(t *testing.T) {
	t.Parallel()
	want := fullConfig()
	b, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	var got Config
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("JSON round trip (-want +got):\n%s\n%s", d, b)
	}
	// Every marshalled field is in the output, durations as strings.
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	names, _ := jsonFields(reflect.TypeFor[Config]())
	for name := range names {
		if _, ok := m[name]; !ok {
			t.Errorf("marshalled config lacks %q: %s", name, b)
		}
	}
	for name, want := range map[string]string{"callTimeout": "1m30s", "transferBudget": "30m0s", "claimTimeout": "20s", "dialTimeout": "15s", "keepaliveInterval": "10s"} {
		if m[name] != want {
			t.Errorf("%s = %#v, want %q", name, m[name], want)
		}
	}
}

func TestConfigYAMLRoundTrip(t *testing.T) {
	t.Parallel()
	want := fullConfig()
	b, err := yaml.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	var got Config
	if err := yaml.UnmarshalStrict(b, &got); err != nil {
		t.Fatalf("UnmarshalStrict:\n%s\n%v", b, err)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("YAML round trip (-want +got):\n%s\n%s", d, b)
	}
	if !strings.Contains(string(b), "callTimeout: 1m30s\n") {
		t.Errorf("durations are not strings:\n%s", b)
	}
}

// fullYAML is fullConfig written by hand, every field, as a file would.
const fullYAML = `
entry: lab-1
owner: operator-a
address: hv1.example.net:22
user: egressproxy
keyFile: /etc/egressproxy/id_ed25519
knownHostsFile: /etc/egressproxy/known_hosts
agentSocket: /run/egressproxy/agent.sock
knownHosts: |
  hv1.example.net ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl
libvirtSocket: /run/libvirt/libvirt-sock
libvirtURI: qemu:///system
pool: egressproxy
images:
  debian-12:
    key: debian-12
    url: https://images.example.net/debian-12.qcow2?v=3
    sha256: abababababababababababababababababababababababababababababababab
    format: qcow2
  alpine:
    url: http://mirror.example.net/alpine.raw
    format: raw
defaultImage: debian-12
transferBudget: 30m
claimTimeout: 20s
machineTypes:
  small: {vcpus: 1, memoryMiB: 512}
  large: {vcpus: 4, memoryMiB: 4096}
defaultMachineType: small
network: default
bridge: br0
domainType: kvm
kernel: /var/lib/egressproxy/vmlinuz
initrd: /var/lib/egressproxy/initrd.img
cmdline: console=ttyS0 root=/dev/vda1
consoleLogDir: /var/log/egressproxy
callTimeout: 1m30s
dialTimeout: 15s
keepaliveInterval: 10s
keepaliveCount: 5
`

func TestConfigYAMLEveryField(t *testing.T) {
	t.Parallel()
	var got Config
	if err := yaml.UnmarshalStrict([]byte(fullYAML), &got); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(fullConfig(), got); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
	// ParseConfig reads the same (it also validates: fullConfig sets two
	// key sources, both known_hosts sources, and network and bridge).
	_, err := ParseConfig([]byte(fullYAML))
	var fields []string
	for _, fe := range errs.FieldErrors(err) {
		fields = append(fields, fe.Field)
	}
	if want := "keyFile,knownHostsFile,agentSocket,knownHosts,bridge"; strings.Join(fields, ",") != want {
		t.Errorf("ParseConfig(fullYAML) names %v, want %s: %v", fields, want, err)
	}
}

// Zero values mean "the default" and are left out; required fields are
// always written, so a marshalled empty Config shows what must be filled.
func TestConfigMarshalZero(t *testing.T) {
	t.Parallel()
	b, err := json.Marshal(Config{})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"entry":"","owner":"","address":"","user":"","pool":""}`; string(b) != want {
		t.Errorf("Marshal(Config{}) = %s, want %s", b, want)
	}
	if got := (Config{MachineTypes: map[string]MachineType{"x": {}}}).String(); !strings.Contains(got, `"x":{"vcpus":0,"memoryMiB":0}`) {
		t.Errorf("a machine type's fields are required and always written: %s", got)
	}
}

func TestParseConfig(t *testing.T) {
	t.Parallel()
	const valid = "entry: lab-1\nowner: operator-a\naddress: hv1:22\nuser: root\nkeyFile: /k\nknownHostsFile: /kh\npool: default\n"
	c, err := ParseConfig([]byte(valid + "callTimeout: 45s\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.CallTimeout != 45*time.Second || c.Network != "" {
		t.Errorf("ParseConfig = %+v: want callTimeout 45s and no defaults filled in", c)
	}
	// JSON is YAML.
	if _, err := ParseConfig([]byte(`{"entry":"lab-1","owner":"o","address":"h:22","user":"u","keyFile":"/k","knownHostsFile":"/kh","pool":"p","dialTimeout":"3s"}`)); err != nil {
		t.Errorf("JSON: %v", err)
	}

	for _, tt := range []struct {
		name, doc, field string
		line             int
		rule             []string
	}{
		{"unknown key", valid + "callTimout: 30s\n", "callTimout", 8, []string{"unknown key", "did you mean callTimeout?"}},
		{"go field name", valid + "CallTimeout: 30s\n", "CallTimeout", 8, []string{"unknown key", "keys are camelCase: write callTimeout"}},
		{"unknown nested key", valid + "machineTypes:\n  small: {vcpus: 1, memoryMiB: 512, disk: 10}\n", "machineTypes.small.disk", 9, []string{"unknown key", "(keys: memoryMiB, vcpus)"}},
		{"bare number duration", valid + "callTimeout: 30\n", "callTimeout", 8, []string{"a bare number would be read as nanoseconds", `"30s"`}},
		{"bad duration string", valid + "dialTimeout: soon\n", "dialTimeout", 8, []string{`"30s"`, "time.ParseDuration"}},
		{"wrong type", valid + "keepaliveCount: three\n", "keepaliveCount", 8, []string{"must be an integer", "not a string"}},
		{"wrong nested type", valid + "machineTypes:\n  small: {vcpus: two, memoryMiB: 512}\n", "machineTypes.small.vcpus", 9, []string{"must be an integer"}},
		{"a string as a number", valid + "network: 12\n", "network", 8, []string{"must be a string", "quote it"}},
		{"validation", valid + "callTimeout: -1s\n", "callTimeout", 8, []string{"must not be negative"}},
		{"claim timeout below its minimum", valid + "claimTimeout: 5s\n", "claimTimeout", 8, []string{"at least 10s", "claimTimeout/4"}},
		{"validation of an image", valid + "images:\n  deb:\n    url: ftp://h/x\n", "images.deb.url", 10, []string{"http"}},
		{"a missing key", "entry: lab-1\nowner: o\naddress: h:22\nuser: u\n", "pool", 0, []string{"is required"}},
		{"a key given twice", valid + "pool: other\n", "pool", 8, []string{"given twice (first on line 7)"}},
		{"a rule naming another key", valid + "initrd: /boot/initrd\n", "initrd", 8, []string{"requires kernel"}},
		{"not a mapping", "- entry: lab-1\n", "config", 1, []string{"must be a mapping", "not a list"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tt.doc))
			if errs.Code(err) != errs.Permanent {
				t.Fatalf("err = %v (%v), want Permanent", err, errs.Code(err))
			}
			fes := errs.FieldErrors(err)
			if len(fes) != 1 || fes[0].Field != tt.field || fes[0].Line != tt.line {
				t.Fatalf("err = %v, want one FieldError for %q on line %d", err, tt.field, tt.line)
			}
			for _, r := range tt.rule {
				if !strings.Contains(fes[0].Rule, r) {
					t.Errorf("rule %q lacks %q", fes[0].Rule, r)
				}
			}
		})
	}

}

// Syntax errors, a second document and text that is not UTF-8 are
// Permanent too, and say their line.
func TestParseConfigSyntax(t *testing.T) {
	t.Parallel()
	const valid = "entry: lab-1\nowner: operator-a\naddress: hv1:22\nuser: root\nkeyFile: /k\nknownHostsFile: /kh\npool: default\n"
	for doc, want := range map[string]string{
		"entry: [\n":                  "line 1",
		"\tentry: x\n":                "line 1",
		valid + "---\nentry: b\n":     "line 8: a second YAML document",
		valid + "user: r\xffot\n":     "line 8: the file is not valid UTF-8 (byte 0xff in column 8)",
		valid + "cmdline: \xc3\x28\n": "line 8: the file is not valid UTF-8 (byte 0xc3 in column 10)",
	} {
		if _, err := ParseConfig([]byte(doc)); errs.Code(err) != errs.Permanent || !strings.Contains(fmt.Sprint(err), want) {
			t.Errorf("ParseConfig(%q) = %v, want Permanent saying %q", doc, err, want)
		}
	}
}

// A file need not name the credentials' sources: the program sets them
// before Open, which requires them, naming the Go fields.
func TestParseConfigCredentials(t *testing.T) {
	t.Parallel()
	const noCreds = "entry: lab-1\nowner: operator-a\naddress: hv1:22\nuser: root\npool: default\n"
	nc, err := ParseConfig([]byte(noCreds))
	if err != nil {
		t.Fatalf("ParseConfig without credential sources = %v, want nil", err)
	}
	if _, err := nc.validate(false); !hasField(err, "KeyFile") || !hasField(err, "KnownHostsFile") {
		t.Errorf("Open's validation of a config without credentials = %v, want FieldErrors for KeyFile and KnownHostsFile", err)
	}
	nc.Key, nc.KnownHosts = []byte("-----BEGIN OPENSSH PRIVATE KEY-----\n"), []byte("hv1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n")
	if _, err := nc.validate(false); err != nil {
		t.Errorf("validation with Key and KnownHosts set = %v, want nil", err)
	}
	// The sources a file does give are checked: two key sources are
	// refused, each named by its key.
	if _, err := ParseConfig([]byte(noCreds + "keyFile: /k\nagentSocket: /run/agent.sock\n")); !hasField(err, "keyFile") || !hasField(err, "agentSocket") {
		t.Errorf("ParseConfig with two key sources = %v, want FieldErrors for keyFile and agentSocket", err)
	}

	// A long unknown key leaves the error bounded.
	_, err = ParseConfig([]byte(noCreds + strings.Repeat("x", 5000) + ": 1\n"))
	if err == nil || len(err.Error()) > errs.MaxErrorText {
		t.Errorf("long key: %d bytes", len(err.Error()))
	}
}

// knownHosts is the text of a known_hosts file: a block scalar in YAML, a
// string in JSON; what it pins reaches the Config byte for byte.
func TestParseConfigKnownHostsText(t *testing.T) {
	t.Parallel()
	const line1 = "hv1.example.net ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
	const line2 = "@cert-authority *.example.net ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
	const head = "entry: lab-1\nowner: o\naddress: hv1:22\nuser: u\nkeyFile: /k\npool: p\n"
	for name, doc := range map[string]string{
		"block":  head + "knownHosts: |\n  # the lab's hosts\n  " + line1 + "\n  " + line2 + "\n",
		"json":   `{"entry":"lab-1","owner":"o","address":"hv1:22","user":"u","keyFile":"/k","pool":"p","knownHosts":"# the lab's hosts\n` + line1 + `\n` + line2 + `\n"}`,
		"binary": head + "knownHosts: !!binary " + base64.StdEncoding.EncodeToString([]byte("# the lab's hosts\n"+line1+"\n"+line2+"\n")) + "\n",
	} {
		c, err := ParseConfig([]byte(doc))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if want := "# the lab's hosts\n" + line1 + "\n" + line2 + "\n"; string(c.KnownHosts) != want {
			t.Errorf("%s: KnownHosts = %q, want %q", name, c.KnownHosts, want)
		}
		if _, err := c.validate(false); err != nil {
			t.Errorf("%s: validate: %v", name, err)
		}
	}
	// Base64 of known_hosts text is not known_hosts text: the rule says
	// what to write instead.
	_, err := ParseConfig([]byte(head + "knownHosts: " + base64.StdEncoding.EncodeToString([]byte(line1+"\n")) + "\n"))
	fes := errs.FieldErrors(err)
	if len(fes) != 1 || fes[0].Field != "knownHosts" || fes[0].Line != 7 || !strings.Contains(fes[0].Rule, `"knownHosts: |"`) {
		t.Errorf("base64 knownHosts: %v", err)
	}
}

// credentialedConfig holds URL credentials of every kind RedactURL knows,
// each a distinct secret.
func credentialedConfig() (Config, []string) {
	c := fullConfig()
	c.Images = map[string]imagecache.Image{
		"userinfo": {URL: "https://op:hunter2hunter2@images.example.net/a.qcow2"},
		"token":    {URL: "https://ghp_abcdef123456@images.example.net/b.qcow2"},
		"s3":       {URL: "https://b.s3.amazonaws.com/k.qcow2?X-Amz-Credential=AKIAEXAMPLE%2F20260101&X-Amz-Signature=deadbeefcafe0123"},
		"query":    {URL: "https://h.example/x.qcow2?token=tok3n-s3cret&v=1#access_token=fr4gsecret"},
		"loose":    {URL: "http://u:pa/ssw0rdsecret@h/x"},
	}
	return c, []string{"hunter2hunter2", "ghp_abcdef123456", "AKIAEXAMPLE", "deadbeefcafe0123", "tok3n-s3cret", "fr4gsecret", "ssw0rdsecret"}
}

// setHidden sets every string or []byte field tagged `json:"-"` (the
// credential fields) to the secret.
func setHidden(c *Config, secret string) {
	v := reflect.ValueOf(c).Elem()
	for i := 0; i < v.NumField(); i++ {
		if v.Type().Field(i).Tag.Get("json") != "-" {
			continue
		}
		switch f := v.Field(i); {
		case f.Kind() == reflect.String:
			f.SetString(secret)
		case f.Kind() == reflect.Slice && f.Type().Elem().Kind() == reflect.Uint8:
			f.SetBytes([]byte(secret))
		}
	}
}

// No secret survives marshalling (JSON, YAML), String, any fmt verb or
// MarshalLog.
func TestConfigNoSecrets(t *testing.T) {
	t.Parallel()
	c, secrets := credentialedConfig()
	const hidden = "hidden-cred3ntial-bytes"
	setHidden(&c, hidden)
	secrets = append(secrets, hidden)

	j, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	y, err := yaml.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	var decoded Config // the URLs as a reader of the file gets them (JSON escapes undone)
	if err := json.Unmarshal(j, &decoded); err != nil {
		t.Fatal(err)
	}
	lg, _ := json.Marshal(c.MarshalLog())
	outs := map[string]string{
		"json": string(j), "yaml": string(y), "decoded": fmt.Sprint(decoded.Images["userinfo"].URL, decoded.Images["s3"].URL, decoded.Images["query"].URL, decoded.Images["loose"].URL, decoded.Images["token"].URL),
		"String": c.String(), "%v": fmt.Sprintf("%v", c), "%+v": fmt.Sprintf("%+v", c), "%#v": fmt.Sprintf("%#v", c), "%s": fmt.Sprintf("%s %q", c, c),
		"pointer %v": fmt.Sprintf("%v", &c), "MarshalLog": string(lg),
	}
	for name, out := range outs {
		for _, s := range secrets {
			if strings.Contains(out, s) {
				t.Errorf("%s carries secret %q:\n%s", name, s, out)
			}
		}
	}
	if !strings.Contains(outs["decoded"], "https://REDACTED@images.example.net/a.qcow2") || !strings.Contains(outs["String"], "images.example.net") {
		t.Errorf("redacted URLs should stay readable: %s", outs["decoded"])
	}
	if got := outs["%#v"]; !strings.HasPrefix(got, "kvm2.Config{") {
		t.Errorf("%%#v = %.60s…", got)
	}
}

// A marshalled credentialed URL comes back redacted; it is refused, naming
// the field, rather than used with "REDACTED" for a password.
func TestConfigRedactedURLRefused(t *testing.T) {
	t.Parallel()
	c := validConfig()
	c.Images = map[string]imagecache.Image{"deb": {URL: "https://op:hunter2hunter2@images.example.net/a.qcow2"}}
	if _, err := c.validate(false); err != nil {
		t.Fatalf("the credentialed config is valid: %v", err)
	}
	_, err := ParseConfig([]byte(c.String()))
	var fe *errs.FieldError
	if !errors.As(err, &fe) || fe.Field != "images.deb.url" || !strings.Contains(fe.Rule, "redacted") || errs.Code(err) != errs.Permanent {
		t.Fatalf("ParseConfig(marshalled) = %v, want a Permanent FieldError on the URL saying it was redacted", err)
	}
	if strings.Contains(err.Error(), "hunter2") {
		t.Errorf("error carries the secret: %v", err)
	}
}

// Fields whose name says they hold a credential must be tagged `json:"-"`
// (they are set in code, from a Secret).
func TestConfigCredentialFieldsHidden(t *testing.T) {
	t.Parallel()
	names, hidden := jsonFields(reflect.TypeFor[Config]())
	var bad []string
	for json, goName := range names {
		n := strings.ToLower(goName)
		if goName == "KeyFile" || goName == "KnownHostsFile" || goName == "KnownHosts" || strings.HasPrefix(n, "keepalive") {
			continue // paths and public host keys
		}
		for _, w := range []string{"key", "passphrase", "password", "signer", "secret", "token"} {
			if strings.Contains(n, w) {
				bad = append(bad, goName+" ("+json+")")
			}
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		t.Errorf("credential fields are marshalled: %v (tag them json:\"-\"); hidden: %v", bad, hidden)
	}
}

// hasField reports whether err holds a *errs.FieldError for field.
func hasField(err error, field string) bool {
	for _, fe := range errs.FieldErrors(err) {
		if fe.Field == field {
			return true
		}
	}
	return false
}
