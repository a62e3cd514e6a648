"""Device profiles: measured kernel-variant choices per shape bucket, and `pie tune`, which measures them.

from pie.profiles import active_profile, variant_chooser
profile, reason = active_profile(device)          # which profile applies, and why
chooser, reason = variant_chooser(device)         # pass as ModelRunner(..., choose_variant=chooser)
"""

from pie.profiles.loader import check_fits, parse_profile
from pie.profiles.lookup import active_profile, resolve, user_profile_dir, user_profile_dirs, variant_chooser
from pie.profiles.schema import SCHEMA_VERSION, Bucket, KernelTuning, Profile, ProfileChooser, ProfileError, Timing
from pie.profiles.writer import dump_profile

__all__ = [
    "SCHEMA_VERSION",
    "Bucket",
    "KernelTuning",
    "Profile",
    "ProfileChooser",
    "ProfileError",
    "Timing",
    "active_profile",
    "check_fits",
    "dump_profile",
    "parse_profile",
    "resolve",
    "user_profile_dir",
    "user_profile_dirs",
    "variant_chooser",
]
