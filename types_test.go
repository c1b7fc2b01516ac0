package egressproxy

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"pgregory.net/rapid"
)

func validSpec() Spec {
	return Spec{Name: "proxy-1", UID: "0b6f1c3e-7d2a-4c55-9a61-2f9e8d7c6b5a", Port: 3128, ImageKey: "debian-12.1", UserData: "#cloud-config\n"}
}

func TestSpecValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		mutate func(*Spec)
		field  string // "" = valid
	}{
		{"valid", func(*Spec) {}, ""},
		{"defaults", func(s *Spec) { s.Port = 0; s.ImageKey = ""; s.UserData = "" }, ""},
		{"max name", func(s *Spec) { s.Name = strings.Repeat("a", 63) }, ""},
		{"name empty", func(s *Spec) { s.Name = "" }, "Name"},
		{"name upper", func(s *Spec) { s.Name = "Proxy" }, "Name"},
		{"name too long", func(s *Spec) { s.Name = strings.Repeat("a", 64) }, "Name"},
		{"name leading dash", func(s *Spec) { s.Name = "-a" }, "Name"},
		{"name trailing dash", func(s *Spec) { s.Name = "a-" }, "Name"},
		{"name double dash", func(s *Spec) { s.Name = "a--b" }, "Name"},
		{"name dot", func(s *Spec) { s.Name = "a.b" }, "Name"},
		{"name slash", func(s *Spec) { s.Name = "a/b" }, "Name"},
		{"name xml", func(s *Spec) { s.Name = "a<b>" }, "Name"},
		{"uid empty", func(s *Spec) { s.UID = "" }, "UID"},
		{"uid too long", func(s *Spec) { s.UID = strings.Repeat("u", 129) }, "UID"},
		{"uid control", func(s *Spec) { s.UID = "a\nb" }, "UID"},
		{"uid bad utf8", func(s *Spec) { s.UID = "a\xffb" }, "UID"},
		{"uid xml and unicode ok", func(s *Spec) { s.UID = `<&"'>ü日本` }, ""},
		{"port negative", func(s *Spec) { s.Port = -1 }, "Port"},
		{"port too big", func(s *Spec) { s.Port = 65536 }, "Port"},
		{"port max", func(s *Spec) { s.Port = 65535 }, ""},
		{"image key upper", func(s *Spec) { s.ImageKey = "Debian" }, "ImageKey"},
		{"image key double dash", func(s *Spec) { s.ImageKey = "a--b" }, "ImageKey"},
		{"image key long", func(s *Spec) { s.ImageKey = strings.Repeat("k", 64) }, "ImageKey"},
		{"image key trailing dot", func(s *Spec) { s.ImageKey = "a." }, "ImageKey"},
		{"machine type bad", func(s *Spec) { s.MachineType = "big_one" }, "MachineType"},
		{"user data max", func(s *Spec) { s.UserData = strings.Repeat("x", naming.MaxUserDataBytes) }, ""},
		{"user data too big", func(s *Spec) { s.UserData = strings.Repeat("x", naming.MaxUserDataBytes+1) }, "UserData"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := validSpec()
			tt.mutate(&s)
			err := s.Validate()
			if tt.field == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want error for %s", tt.field)
			}
			if Code(err) != Permanent {
				t.Errorf("Code = %v, want Permanent", Code(err))
			}
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field != tt.field {
				t.Errorf("error %v does not name field %s", err, tt.field)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("message %q does not name %s", err, tt.field)
			}
		})
	}
}

func TestSpecValidateReportsEveryField(t *testing.T) {
	t.Parallel()
	err := Spec{Port: 70000}.Validate()
	for _, f := range []string{"Name", "UID", "Port"} {
		if !strings.Contains(err.Error(), "invalid "+f) {
			t.Errorf("%q does not mention %s", err, f)
		}
	}
}

// volumeComponent is the rule a name must meet to be embedded in a libvirt
// volume or domain name: no path separators, no XML or shell metacharacters,
// lowercase DNS label.
var volumeComponent = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

func TestPropertyAcceptedNamesAreVolumeComponents(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		name := rapid.OneOf(
			rapid.StringMatching(`[a-z0-9-]{0,70}`),
			rapid.String(),
			rapid.StringMatching(`[a-z0-9][a-z0-9.\-_A-Z]{0,65}`),
		).Draw(t, "name")
		err := naming.ValidateName("Name", name)
		if err == nil {
			if !volumeComponent.MatchString(name) || strings.Contains(name, "--") {
				t.Fatalf("accepted %q, which is not a safe volume-name component", name)
			}
			return
		}
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != "Name" || !strings.Contains(err.Error(), "Name") {
			t.Fatalf("rejection of %q does not name the field: %v", name, err)
		}
	})
}

func TestPropertySpecRejectionsNameAField(t *testing.T) {
	t.Parallel()
	fields := map[string]bool{"Name": true, "UID": true, "Port": true, "ImageKey": true, "MachineType": true, "UserData": true}
	rapid.Check(t, func(t *rapid.T) {
		s := Spec{
			Name:        rapid.StringMatching(`[a-zA-Z0-9.\-]{0,66}`).Draw(t, "name"),
			UID:         rapid.String().Draw(t, "uid"),
			Port:        rapid.IntRange(-10, 70000).Draw(t, "port"),
			ImageKey:    rapid.StringMatching(`[a-z0-9.\-A-Z]{0,66}`).Draw(t, "key"),
			MachineType: rapid.StringMatching(`[a-z0-9.\-_]{0,10}`).Draw(t, "mt"),
			UserData:    strings.Repeat("x", rapid.IntRange(0, naming.MaxUserDataBytes+10).Draw(t, "udlen")),
		}
		err := s.Validate()
		if err == nil {
			if naming.ValidateName("Name", s.Name) != nil || s.UID == "" || s.Port < 0 || s.Port > 65535 || len(s.UserData) > naming.MaxUserDataBytes {
				t.Fatalf("accepted invalid spec %+v", s)
			}
			return
		}
		if Code(err) != Permanent {
			t.Fatalf("Code = %v", Code(err))
		}
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("no FieldError in %v", err)
		}
		for _, line := range strings.Split(err.Error(), "\n") {
			named := false
			for f := range fields {
				if strings.HasPrefix(line, "invalid "+f) {
					named = true
				}
			}
			if !named {
				t.Fatalf("line %q does not name a field", line)
			}
		}
	})
}

func FuzzSpecValidate(f *testing.F) {
	f.Add("proxy-1", "uid", 3128, "debian-12", "#cloud-config")
	f.Add("a--b", "", -1, "K", "")
	f.Add(strings.Repeat("a", 64), "\x00", 65536, "a.", "x")
	f.Fuzz(func(t *testing.T, name, uid string, port int, key, ud string) {
		s := Spec{Name: name, UID: uid, Port: port, ImageKey: key, UserData: ud}
		err := s.Validate()
		if err == nil {
			if !volumeComponent.MatchString(name) {
				t.Fatalf("accepted bad name %q", name)
			}
			return
		}
		if Code(err) != Permanent {
			t.Fatalf("Code = %v", Code(err))
		}
	})
}

func TestInstanceAddress(t *testing.T) {
	t.Parallel()
	if (Instance{}).Address() != "" {
		t.Fatal("empty")
	}
	if got := (Instance{IP: "::1", Port: 3128}).Address(); got != "[::1]:3128" {
		t.Fatal(got)
	}
}

// TestSpecDigestGolden pins the digest of one spec: a change of the
// encoding would make every recorded digest differ (a spurious
// ErrSpecConflict for every existing instance), so it must fail here. The
// value was computed independently from the documented encoding.
func TestSpecDigestGolden(t *testing.T) {
	t.Parallel()
	const want = "sha256:c718a3515fe989564b46f5623f14b0433eed1b571118145a978b8c11f2143d5c"
	if got := validSpec().Digest(); got != want {
		t.Errorf("Digest() = %s, want %s", got, want)
	}
	if !regexp.MustCompile(`^sha256:[0-9a-f]{64}$`).MatchString(validSpec().Digest()) {
		t.Errorf("Digest() = %q, want sha256: and 64 lowercase hex digits", validSpec().Digest())
	}
}

func TestSpecDigestFields(t *testing.T) {
	t.Parallel()
	base := validSpec()
	d := base.Digest()
	for _, tc := range []struct {
		name   string
		mutate func(*Spec)
		same   bool
	}{
		{"identical", func(*Spec) {}, true},
		{"port 0 is naming.DefaultPort", func(s *Spec) { s.Port = 0 }, true},
		{"name", func(s *Spec) { s.Name = "proxy-2" }, false},
		{"uid", func(s *Spec) { s.UID += "x" }, false},
		{"port", func(s *Spec) { s.Port = 8080 }, false},
		{"image key", func(s *Spec) { s.ImageKey = "debian-12.2" }, false},
		{"image key default", func(s *Spec) { s.ImageKey = "" }, false},
		{"machine type", func(s *Spec) { s.MachineType = "small" }, false},
		{"user-data", func(s *Spec) { s.UserData += " " }, false},
		{"user-data empty", func(s *Spec) { s.UserData = "" }, false},
		// Length prefixes: moving bytes from one field to the next changes
		// the digest.
		{"shifted boundary", func(s *Spec) { s.Name, s.UID = s.Name+s.UID[:1], s.UID[1:] }, false},
		{"shifted into user-data", func(s *Spec) { s.MachineType, s.UserData = "", "x"+s.UserData }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := base
			tc.mutate(&s)
			if got := s.Digest() == d; got != tc.same {
				t.Errorf("digest equal to the base's = %v, want %v (%s vs %s)", got, tc.same, s.Digest(), d)
			}
		})
	}
}

// TestSpecDigestProperty: two specs have the same digest exactly when they
// are equal once Port is normalised.
func TestSpecDigestProperty(t *testing.T) {
	t.Parallel()
	field := rapid.SampledFrom([]string{"", "a", "b", "ab", "a\x00", "\x00", "ü"})
	gen := rapid.Custom(func(t *rapid.T) Spec {
		return Spec{
			Name: field.Draw(t, "name"), UID: field.Draw(t, "uid"),
			Port:     rapid.SampledFrom([]int{0, naming.DefaultPort, 1, 8080}).Draw(t, "port"),
			ImageKey: field.Draw(t, "image"), MachineType: field.Draw(t, "mt"), UserData: field.Draw(t, "ud"),
		}
	})
	rapid.Check(t, func(t *rapid.T) {
		a, b := gen.Draw(t, "a"), gen.Draw(t, "b")
		na, nb := a, b
		na.Port, nb.Port = a.EffectivePort(), b.EffectivePort()
		if (a.Digest() == b.Digest()) != (na == nb) {
			t.Fatalf("%+v → %s and %+v → %s: digest equality disagrees with spec equality", a, a.Digest(), b, b.Digest())
		}
	})
}

func TestFieldErrors(t *testing.T) {
	t.Parallel()
	a := &FieldError{Field: "Name", Rule: "is required"}
	b := &FieldError{Field: "Port", Value: "-1", Rule: "must be 0 (default 3128) or 1-65535"}
	err := errs.WithCode(Permanent, fmt.Errorf("create: %w", errors.Join(a, fmt.Errorf("x: %w", b))))
	got := FieldErrors(err)
	if len(got) != 2 || got[0] != a || got[1] != b {
		t.Errorf("FieldErrors = %v, want [%v %v]", got, a, b)
	}
	if FieldErrors(errors.New("plain")) != nil || FieldErrors(nil) != nil {
		t.Error("FieldErrors of an error without FieldError is not nil")
	}
	if got := FieldErrors(Spec{}.Validate()); len(got) < 2 {
		t.Errorf("Spec{}.Validate(): %d FieldErrors, want Name and UID at least", len(got))
	}
}
