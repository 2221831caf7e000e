"Package setup, driven by settings.ini as nbdev's template does (without pkg_resources)."
from configparser import ConfigParser
from pathlib import Path
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read(Path(__file__).parent/'settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']
req = lambda k: cfg.get(k, '').split()

licenses = {'apache2': 'Apache-2.0'}  # an SPDX expression (license classifiers are deprecated: setuptools warns at install)
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
lic = licenses[cfg['license']]
readme = Path(__file__).parent/'README.md'

setuptools.setup(
    name=cfg['lib_name'], version=cfg['version'], description=cfg['description'],
    license_expression=lic, classifiers=[
        'Development Status :: ' + statuses[int(cfg['status'])], 'Intended Audience :: ' + cfg['audience'].title(),
        'Natural Language :: ' + cfg['language'].title(),
        'Programming Language :: Python :: 3', 'Topic :: Scientific/Engineering :: Artificial Intelligence'],
    url=cfg['git_url'], author=cfg['author'], author_email=cfg['author_email'], keywords=cfg['keywords'],
    packages=setuptools.find_packages(include=['fastai_dali', 'fastai_dali.*']), include_package_data=True,
    python_requires='>=' + cfg['min_python'],
    install_requires=req('requirements'),
    # One DALI wheel per CUDA major version: pick the extra for your driver, never both
    extras_require={'cuda120': req('dali_cuda120'), 'cuda130': req('dali_cuda130'), 'test': req('test_requirements'),
                    'dev': req('test_requirements') + req('dev_requirements')},
    long_description=readme.read_text(encoding='utf-8') if readme.exists() else '',
    long_description_content_type='text/markdown', zip_safe=False,
    entry_points={'console_scripts': req('console_scripts'), 'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
)
