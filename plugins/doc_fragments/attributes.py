# Copyright (c) kubenode.proxy contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)


class ModuleDocFragment:
    # The platform attribute every module of this collection shares: they program the Linux
    # kernel (netfilter, ipset, IPVS, conntrack) of the managed host.
    PLATFORM = r"""
options: {}
attributes:
  platform:
    description: Target OS/families that can be operated against.
    support: full
    platforms: linux
"""
