package domainmeta

import (
	"errors"
	"strings"
	"testing"
	"time"
)

const element = `<ep:instance xmlns:ep="https://egressproxy.dev/xmlns/instance/v1"><ep:uid>u1</ep:uid>` +
	`<ep:created>2026-11-30T12:00:00.5+01:00</ep:created><ep:entry>lab-1</ep:entry><ep:owner>o</ep:owner>` +
	`<ep:port> 3128 </ep:port><ep:spec-digest> sha256:ab </ep:spec-digest></ep:instance>`

func TestParse(t *testing.T) {
	t.Parallel()
	want := Meta{UID: "u1", Created: time.Date(2026, 11, 30, 11, 0, 0, 5e8, time.UTC), Entry: "lab-1", Owner: "o", Port: 3128, SpecDigest: "sha256:ab"}
	for _, tc := range []struct {
		name    string
		doc     string
		want    Meta
		wantErr string // "": none
		noMeta  bool
	}{
		{name: "element alone", doc: element, want: want},
		{name: "in a domain", doc: `<domain><name>x</name><metadata><other xmlns="urn:x"/>` + element + `</metadata></domain>`, want: want},
		{name: "first of two", doc: `<m>` + element + strings.Replace(element, "u1", "u2", 1) + `</m>`, want: want},
		{name: "no spec digest", doc: strings.Replace(element, "<ep:spec-digest> sha256:ab </ep:spec-digest>", "", 1), want: Meta{UID: "u1", Created: want.Created, Entry: "lab-1", Owner: "o", Port: 3128}},
		{name: "absent", doc: `<domain><name>x</name></domain>`, noMeta: true},
		{name: "empty", doc: ``, noMeta: true},
		{name: "other version", doc: strings.Replace(element, "instance/v1", "instance/v2", 1), noMeta: true},
		{name: "no uid", doc: strings.Replace(element, "<ep:uid>u1</ep:uid>", "", 1), wantErr: "required"},
		{name: "no owner", doc: strings.Replace(element, "<ep:owner>o</ep:owner>", "<ep:owner></ep:owner>", 1), wantErr: "required"},
		{name: "bad created", doc: strings.Replace(element, "2026-11-30T12:00:00.5+01:00", "yesterday", 1), wantErr: "created"},
		{name: "port 0", doc: strings.Replace(element, " 3128 ", "0", 1), wantErr: "port"},
		{name: "port 65536", doc: strings.Replace(element, " 3128 ", "65536", 1), wantErr: "port"},
		{name: "syntax error before", doc: `<domain><name>x</nam>` + element, wantErr: "syntax"},
		{name: "syntax error inside", doc: strings.Replace(element, "</ep:uid>", "</ep:uidx>", 1), wantErr: "syntax"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Parse(tc.doc)
			switch {
			case tc.noMeta:
				if !errors.Is(err, ErrNoMetadata) {
					t.Fatalf("Parse = %+v, %v; want ErrNoMetadata", got, err)
				}
			case tc.wantErr != "":
				if err == nil || errors.Is(err, ErrNoMetadata) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Parse = %+v, %v; want an error with %q", got, err, tc.wantErr)
				}
				if got != (Meta{}) {
					t.Fatalf("Parse returned %+v with its error", got)
				}
			case err != nil || got != tc.want:
				t.Fatalf("Parse = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}
