package kvm2_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/kvm2"
)

// entryJSON is one provider entry as an embedder might keep it in a
// configuration file: camelCase keys, durations as strings, zero values
// (defaults) left out. docs/config.md lists every field.
const entryJSON = `{
	"entry": "lab-1",
	"owner": "my-operator",
	"address": "hv1.example.net:22",
	"user": "egressproxy",
	"keyFile": "/etc/egressproxy/id_ed25519",
	"knownHostsFile": "/etc/egressproxy/known_hosts",
	"pool": "default",
	"images": {
		"debian-12": {
			"url": "https://images.example.net/debian-12-squid.qcow2",
			"sha256": "0f3c4e9a8b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e"
		}
	},
	"callTimeout": "2m"
}`

// Open validates the Config and returns the portable client of the entry
// without touching the host: the first call dials.
func ExampleOpen() {
	cfg, err := kvm2.ParseConfig([]byte(entryJSON)) // strict: a mistyped key is an error
	if err != nil {
		fmt.Println(err)
		return
	}
	client, err := kvm2.Open(context.Background(), cfg, nil) // nil *Options: no logs, no spans
	if err != nil {
		fmt.Println(err)
		return
	}
	defer client.Close() // closes the entry's connections

	// What an embedder does next with the client (its first call dials the host):
	//
	//	inst, err := client.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: string(obj.UID)})
	//	switch {
	//	case err == nil: // inst.State, inst.Address()
	//	case errors.Is(err, egressproxy.ErrTransient): // requeue with backoff
	//	default: // report it; a person or a changed spec must act
	//	}
	fmt.Println("opened", cfg.Entry, "on", cfg.Address)
	// Output:
	// opened lab-1 on hv1.example.net:22
}

// ParseConfig reads YAML or JSON strictly and reports every problem at
// once, each naming the key path as the file writes it and its line.
func ExampleParseConfig() {
	_, err := kvm2.ParseConfig([]byte(`
entry: lab-1
owner: my-operator
address: hv1.example.net:22
user: egressproxy
pool: default
CallTimeout: 30s
images:
  deb:
    url: https://images.example.net/debian-12.qcow2
    formt: raw
machineTypes:
  small: {vcpus: 0, memoryMiB: 512}
knownHosts: |
  hv1.example.net ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl
`))
	fmt.Println(egressproxy.Code(err))
	for _, fe := range egressproxy.FieldErrors(err) {
		fmt.Println(fe)
	}
	// Output:
	// Permanent
	// line 7: invalid CallTimeout: unknown key; keys are camelCase: write callTimeout
	// line 11: invalid images.deb.formt: unknown key; did you mean format?
	// line 13: invalid machineTypes.small.vcpus "0": must be 1-256
}

// ParseEntries reads a file that lists several entries next to a
// program's own settings, and names every problem with its entry's index.
func ExampleParseEntries() {
	var settings struct {
		Target string        `json:"target"`
		Every  time.Duration `json:"every"`
	}
	_, err := kvm2.ParseEntries([]byte(`
target: example.com:443
every: 30
entries:
- entry: hv1
  owner: my-tool
  address: hv1.example.net:22
  user: egressproxy
  keyFile: /etc/egressproxy/id_ed25519
  knownHostsFile: /etc/egressproxy/known_hosts
  pool: default
- entry: hv1
  owner: my-tool
  address: hv2.example.net
  user: egressproxy
  agentSocket: /run/agent.sock
  knownHostsFile: /etc/egressproxy/known_hosts
  pool: default
  images:
    deb: {url: https://images.example.net/debian-12.qcow2, sha256: abc}
`), &settings)
	for _, fe := range egressproxy.FieldErrors(err) {
		fmt.Println(fe)
	}
	// Output:
	// line 3: invalid every "30": must be a duration such as "30s", "2m" or "1h30m" (Go's time.ParseDuration syntax); a bare number would be read as nanoseconds: give its unit
	// line 12: invalid entries[1].entry "hv1": is also the name of entries[0]: every entry needs its own
	// line 14: invalid entries[1].address "hv2.example.net": must be host:port
	// line 20: invalid entries[1].images.deb.sha256 "abc": must be 64 lowercase hex digits
}

// A bad Config is one Permanent error naming every field that is wrong and
// its rule, so a configuration file is fixed in one pass.
func ExampleOpen_invalidConfig() {
	_, err := kvm2.Open(context.Background(), kvm2.Config{
		Entry:   "Lab_1",
		Owner:   "my-operator",
		Address: "hv1.example.net", // no port
		Network: "default",
		Bridge:  "br0", // a NIC joins one or the other
		// User, KeyFile, KnownHostsFile and Pool are missing.
	}, nil)
	fmt.Println(egressproxy.Code(err))
	for _, fe := range egressproxy.FieldErrors(err) {
		fmt.Println(fe.Field)
	}
	// Output:
	// Permanent
	// Entry
	// Address
	// User
	// KeyFile
	// KnownHostsFile
	// Pool
	// Bridge
}

// Check reports an unusable entry as a Health with a Reason rather than an
// error, so a controller can show it in a condition. Here the key file does
// not exist, which Check reports before dialing.
func ExampleOpen_check() {
	var cfg kvm2.Config
	if err := json.Unmarshal([]byte(entryJSON), &cfg); err != nil {
		fmt.Println(err)
		return
	}
	cfg.Address = "127.0.0.1:1"
	cfg.KeyFile = filepath.Join("testdata", "no-such-key")
	p, err := kvm2.Open(context.Background(), cfg, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := p.Check(ctx)
	fmt.Println(h.Reachable, h.Reason, err)

	p.Close()
	_, err = p.Check(ctx)
	fmt.Println(errors.Is(err, egressproxy.ErrClosed), egressproxy.Code(err))
	// Output:
	// false CredentialsUnavailable <nil>
	// true Permanent
}
