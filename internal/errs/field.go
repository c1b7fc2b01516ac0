package errs

import "strconv"

// FieldError is a bad-input error naming the field and the rule it broke.
// It is always classed Permanent by Validate. Its text is
//
//	line <Line>: invalid <Field> <Quote(Value)>: <Rule>
//
// (without the line when Line is zero, without the value when Value is
// empty), clipped to MaxErrorText bytes: Value is printed escaped and
// bounded by Quote, so any input is safe to put in it as given.
type FieldError struct {
	Field string
	Value string // the offending value as given; Error quotes and bounds it
	Rule  string
	Line  int // the line of the file the field is on (1-based); zero: none
}

func (e *FieldError) Error() string {
	var at string
	if e.Line > 0 {
		at = "line " + strconv.Itoa(e.Line) + ": "
	}
	if e.Value == "" {
		return ClipMessage(at + "invalid " + e.Field + ": " + e.Rule)
	}
	return ClipMessage(at + "invalid " + e.Field + " " + Quote(e.Value) + ": " + e.Rule)
}

// FieldErrors returns every *FieldError in err's tree (through %w wraps,
// errors.Join and *Error), in order: the violations a validation error
// reports all at once, for an embedder that shows them per field (a
// condition, an event, a form). It returns nil when err has none.
func FieldErrors(err error) []*FieldError {
	var out []*FieldError
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) {
		case nil:
			return
		case *FieldError:
			out = append(out, e)
		}
		switch e := err.(type) {
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				walk(inner)
			}
		case interface{ Unwrap() error }:
			walk(e.Unwrap())
		}
	}
	walk(err)
	return out
}
