package duration

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"
	"sigs.k8s.io/yaml"
)

type durationHolder struct {
	Timeout Duration `json:"timeout,omitempty"`
}

func TestDurationMarshal(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		want string
	}{
		{30 * time.Second, `"30s"`},
		{90 * time.Second, `"1m30s"`},
		{2 * time.Minute, `"2m0s"`},
		{500 * time.Millisecond, `"500ms"`},
		{-time.Second, `"-1s"`},
		{0, `"0s"`},
	} {
		b, err := json.Marshal(Duration(tt.d))
		if err != nil || string(b) != tt.want {
			t.Errorf("Marshal(%v) = %s, %v; want %s", tt.d, b, err, tt.want)
		}
	}
	// omitempty drops a zero Duration (zero means "the default" everywhere).
	if b, _ := json.Marshal(durationHolder{}); string(b) != `{}` {
		t.Errorf("zero with omitempty = %s, want {}", b)
	}
	if b, _ := yaml.Marshal(durationHolder{Timeout: Duration(30 * time.Second)}); string(b) != "timeout: 30s\n" {
		t.Errorf("yaml = %q, want %q", b, "timeout: 30s\n")
	}
}

func TestDurationUnmarshal(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want time.Duration
	}{
		{`{"timeout":"30s"}`, 30 * time.Second},
		{`{"timeout":"1h30m"}`, 90 * time.Minute},
		{`{"timeout":"250ms"}`, 250 * time.Millisecond},
		{`{"timeout":"0s"}`, 0},
		{`{"timeout":"-5s"}`, -5 * time.Second},
		{`{"timeout":"\u0033s"}`, 3 * time.Second}, // JSON escapes are decoded
		{`{"timeout":null}`, 7},                    // null leaves the value as it was
		{`{}`, 7},
	} {
		h := durationHolder{Timeout: 7}
		if err := json.Unmarshal([]byte(tt.in), &h); err != nil || time.Duration(h.Timeout) != tt.want {
			t.Errorf("Unmarshal(%s) = %v, %v; want %v", tt.in, h.Timeout, err, tt.want)
		}
	}
	var h durationHolder
	if err := yaml.Unmarshal([]byte("timeout: 45s\n"), &h); err != nil || time.Duration(h.Timeout) != 45*time.Second {
		t.Errorf("yaml: %v, %v", h.Timeout, err)
	}
}

// A bare number is refused: 30 would be 30 nanoseconds. The error names the
// field (through encoding/json's type-error context) and the rule.
func TestDurationRejects(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want []string
	}{
		{`{"timeout":30}`, []string{"number 30", "durationHolder.timeout", "time.ParseDuration", "nanoseconds", `"30s"`}},
		{`{"timeout":0}`, []string{"number 0", "durationHolder.timeout", "nanoseconds"}},
		{`{"timeout":1.5e9}`, []string{"number 1.5e9", "durationHolder.timeout"}},
		{`{"timeout":"30"}`, []string{`string "30"`, "durationHolder.timeout", "time.ParseDuration"}},
		{`{"timeout":"soon"}`, []string{`string "soon"`, "durationHolder.timeout"}},
		{`{"timeout":true}`, []string{"bool", "durationHolder.timeout"}},
		{`{"timeout":{"seconds":3}}`, []string{"object", "durationHolder.timeout"}},
		{`{"timeout":["3s"]}`, []string{"array", "durationHolder.timeout"}},
	} {
		var h durationHolder
		err := json.Unmarshal([]byte(tt.in), &h)
		var te *json.UnmarshalTypeError
		if !errors.As(err, &te) {
			t.Errorf("Unmarshal(%s) = %v, want a *json.UnmarshalTypeError", tt.in, err)
			continue
		}
		for _, w := range tt.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("Unmarshal(%s) error %q does not contain %q", tt.in, err, w)
			}
		}
	}
	// Through YAML too: "timeout: 30" is a number.
	var h durationHolder
	err := yaml.Unmarshal([]byte("timeout: 30\n"), &h)
	if err == nil || !strings.Contains(err.Error(), "durationHolder.timeout") || !strings.Contains(err.Error(), "nanoseconds") {
		t.Errorf("yaml bare number: %v", err)
	}
	// A huge number is clipped in the text.
	err = json.Unmarshal([]byte(`{"timeout":`+strings.Repeat("9", 5000)+`}`), &h)
	if err == nil || len(err.Error()) > 512 {
		t.Errorf("huge number: error of %d bytes", len(err.Error()))
	}
}

// Every Duration survives a round trip through its text.
func TestDurationRoundTripProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		d := Duration(rapid.Int64().Draw(t, "d"))
		b, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		var got Duration
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("Unmarshal(%s): %v", b, err)
		}
		if got != d {
			t.Fatalf("round trip %d → %s → %d", d, b, got)
		}
	})
}
